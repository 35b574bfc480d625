"""A run directory as `tandem report` reads it: config.yaml as a plain dict and metrics.jsonl as one
column of numbers per key (the record indices that hold it and their values), read line by line:
200k records of about 25 numbers each take 69 MB, where one dict per record took 443 MB.
"""

from __future__ import annotations

import json
import os
from array import array
from dataclasses import dataclass, field
from typing import Dict, Iterable, Iterator, List, Optional, Tuple

from .config_yaml import read_yaml_mapping


class ReportError(ValueError):
    """A run directory that cannot be reported on (the message names the path)."""


@dataclass
class Run:
    label: str
    """Legend label: the directory's name, or what --labels gave."""
    path: str
    """The run directory."""
    steps: "array"
    """Each record's step, in file order (a resumed run's file was truncated at the resume
    step)."""
    columns: Dict[str, Tuple["array", "array"]]
    """key -> (the indices of the records that hold a number under it, those numbers): 16 bytes a
    number, where a dict per record spent about 95."""
    last: dict
    """The last record, whole."""
    config: dict = field(default_factory=dict)
    """config.yaml as a plain dict (empty when the run has none)."""

    def series(self, key: str) -> Tuple[List[int], List[float]]:
        """(steps, values) of every record that has a number under `key`."""
        rows, values = self.columns.get(key, ((), ()))
        return [self.steps[i] for i in rows], list(values)

    def aligned(self, *keys: str) -> Tuple[List[int], List[List[float]]]:
        """(steps, one list per key) of the records that have a number under every key."""
        found = [dict(zip(*self.columns.get(key, ((), ())))) for key in keys]
        order = sorted(set.intersection(*(set(f) for f in found)))
        return [self.steps[i] for i in order], [[f[i] for i in order] for f in found]

    def keys(self) -> List[str]:
        return list(self.columns)

    def main_variant(self) -> str:
        # greedy since eval.temperatures; older runs chose their one setting with eval.temperature
        temperature = float(self.config.get("eval", {}).get("temperature", 0.0) or 0.0)
        return "greedy" if temperature == 0 else f"T={temperature:g}"

    @classmethod
    def from_records(cls, label: str, path: str, records: Iterable[dict],
                     config: Optional[dict] = None) -> "Run":
        """The run of `records` (dicts with a "step", read one at a time); ReportError without
        any."""
        steps, columns, last = array("q"), {}, None
        for rec in records:
            row = len(steps)
            for key, value in rec.items():
                if type(value) in _NUMBERS and key != "step":  # (not null, a string, a list)
                    column = columns.get(key)
                    if column is None:
                        column = columns[key] = (array("l"), array("d"))
                    column[0].append(row)
                    column[1].append(value)
            steps.append(int(rec["step"]))
            last = rec
        if last is None:
            raise ReportError(f"{os.path.join(path, 'metrics.jsonl')!r} holds no records")
        return cls(label, path, steps, columns, last, config or {})


_NUMBERS = (float, int, bool)
"""What a column holds (an array of doubles takes bools and ints as they are)."""


def read_run(path: str, label: Optional[str] = None) -> Run:
    metrics = os.path.join(path, "metrics.jsonl")
    if not os.path.isfile(metrics):
        raise ReportError(f"run directory {path!r} has no metrics.jsonl")
    cfg_path = os.path.join(path, "config.yaml")
    config = (read_yaml_mapping(cfg_path, cfg_path, ReportError) if os.path.isfile(cfg_path)
              else {})
    with open(metrics) as f:  # line by line: a long run's file is hundreds of MB
        return Run.from_records(label or os.path.basename(os.path.normpath(path)), path,
                                _records(f, metrics), config)


def _records(lines: Iterable[str], metrics: str) -> Iterator[dict]:
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            # NaN / Infinity (another writer's: Tandem writes null) read as missing: a NaN final
            # evaluation hid the run's last finite one behind "an interval without width"
            rec = json.loads(line, parse_constant=lambda _: None)
        except json.JSONDecodeError:
            if not line.endswith("\n"):  # a last line torn by a crash mid-write
                continue
            raise ReportError(f"{metrics}:{number}: not a JSON record") from None
        if isinstance(rec, dict) and "step" in rec:
            yield rec
