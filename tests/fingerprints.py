"""Fingerprints of every training artifact the tests build, to show that a restructuring of the
training code leaves its output byte-identical.

``ONNX_AUTODIFF_FINGERPRINTS=FILE python -m pytest tests/...`` records, for each test, the SHA-256
of each artifacts' models, checkpoint and layout in the order the test builds them (as JSON lines:
test id, call index, digests); run it before and after a change and compare the two files with
``python tests/fingerprints.py BEFORE AFTER``. Builds in the processes the tests start are not
recorded.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import sys

import numpy as np

ENV = "ONNX_AUTODIFF_FINGERPRINTS"
_current = {"test": None, "count": 0}


def digests(artifacts) -> dict[str, str]:
    """The SHA-256 of each part of ``artifacts`` (a TrainingArtifacts)."""
    def sha(data: bytes) -> str:
        return hashlib.sha256(data).hexdigest()

    parts = {name: sha(getattr(artifacts, name).SerializeToString())
             for name in artifacts.FILES if getattr(artifacts, name, None) is not None}
    checkpoint = hashlib.sha256()
    for name in sorted(artifacts.checkpoint):
        value = np.ascontiguousarray(artifacts.checkpoint[name])
        checkpoint.update(f"{name}:{value.dtype}:{value.shape}".encode())
        checkpoint.update(value.tobytes())
    parts["checkpoint"] = checkpoint.hexdigest()
    parts["layout"] = sha(json.dumps(artifacts.layout, sort_keys=True, default=str).encode())
    parts["left_out"] = sha(json.dumps(list(artifacts.left_out)).encode())
    return parts


def install(path: str) -> None:
    """Records the digests of each generated artifacts into ``path`` (appended)."""
    from onnx_autodiff.training import artifacts as module

    generate = module._generate_artifacts

    @functools.wraps(generate)
    def recorded(*args, **kwargs):
        result = generate(*args, **kwargs)
        _current["count"] += 1
        with open(path, "a", encoding="utf-8") as file:
            file.write(json.dumps({"test": _current["test"], "call": _current["count"], **digests(result)}) + "\n")
        return result

    module._generate_artifacts = recorded


def starting(test_id: str) -> None:
    _current["test"], _current["count"] = test_id, 0


def compare(before: str, after: str) -> int:
    """Prints the builds whose digests differ, or are in one file only; 0 when none."""
    def read(path):
        with open(path, encoding="utf-8") as file:
            return {(r.pop("test"), r.pop("call")): r for r in map(json.loads, file)}

    old, new = read(before), read(after)
    differ = sorted(key for key in old.keys() & new.keys() if old[key] != new[key])
    for key in differ:
        parts = sorted(part for part in old[key].keys() | new[key].keys() if old[key].get(part) != new[key].get(part))
        print(f"differs: {key[0]} #{key[1]}: {', '.join(parts)}")
    for label, keys in (("only before", old.keys() - new.keys()), ("only after", new.keys() - old.keys())):
        for key in sorted(keys):
            print(f"{label}: {key[0]} #{key[1]}")
    print(f"{len(old.keys() & new.keys())} builds in both, {len(differ)} differ, "
          f"{len(old.keys() ^ new.keys())} in one file only")
    return int(bool(differ or old.keys() ^ new.keys()))


if __name__ == "__main__":
    sys.exit(compare(*sys.argv[1:3]))
