"""OpenAI's Batch API on the live engine: `/v1/files` and `/v1/batches` (`api.py`), a store that survives restarts
(`store.py`), lines run through the endpoints they name (`lines.py`) in the scheduler's batch tier, fed a bounded
number at a time (`runner.py`), and the same file run offline (`offline.py`, `conveyor batch run`)."""
