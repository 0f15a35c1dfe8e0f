"""Batch jobs: requests read from files, OpenAI Batch lines, the result log, data-parallel groups."""
