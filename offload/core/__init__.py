"""The base layer: errors, the model config, presets, sampling parameters and outputs."""
