"""The driver's live run: context and typed state, lifecycle, worker start-up and recovery."""
