"""The Python API: `LLM` (llm), its model front, its plan, the decode loop and `EngineArgs`."""
