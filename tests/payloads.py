"""A pickle payload for the tests that prove a run folder never runs code."""

from __future__ import annotations

import os


class RunsCode:
    """Unpickling this creates a marker file: the proof that a load ran code."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))
