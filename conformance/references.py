"""Stored oracle answers: per case, seed and onnx version the finite-difference estimates, kink
intervals and flags, in one compressed ``.npz`` (the packaged one: ``references/oracle.npz``);
sweeps compare backward graphs with them instead of running finite differences."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np
import onnx

from onnx_autodiff.conformance.oracle import FDGradient, OracleResult
from onnx_autodiff.files import write_atomically

REFERENCES_DIR = Path(__file__).with_name("references")
DEFAULT_REFERENCES = REFERENCES_DIR / "oracle.npz"
"""The stored oracle answers shipped with the package (regenerate: see :mod:`onnx_autodiff.conformance.runner`)."""

ORACLE_REVISION = 2
"""Stored in saved references; 2: half-precision models widened to float32 in the fallback, one-sided flags."""

_FLAGS = ("kink", "unstable", "discontinuous", "nonfinite", "shape_changed", "one_sided")
_REFERENCE_FORMAT = 1


def case_fingerprint(model: bytes, feeds: Mapping[str, np.ndarray], cotangents) -> str:
    """A short hash of what the oracle's answer depends on besides the seed: model, point, r."""
    digest = hashlib.sha256(model)
    for name in sorted(feeds):
        value = np.asarray(feeds[name])
        digest.update(f"{name}:{value.dtype}:{value.shape}".encode())
        digest.update(repr(value.tolist()).encode() if value.dtype.kind == "O" else np.ascontiguousarray(value).tobytes())
    for r in cotangents:
        digest.update(b"-" if r is None else f"{r.dtype}:{r.shape}".encode() + np.ascontiguousarray(r).tobytes())
    return digest.hexdigest()[:16]


@dataclasses.dataclass
class StoredOracle:
    """The oracle's answer for one case: per input its :class:`FDGradient` (evaluated coordinates
    only), or ``error`` when the oracle could not evaluate the model."""

    fingerprint: str
    backend: str = ""
    weak: bool = False
    f0: float = float("nan")
    error: str | None = None
    details: dict = dataclasses.field(default_factory=dict)
    float32: dict = dataclasses.field(default_factory=dict)  # input → values storable in float32

    @classmethod
    def from_oracle(cls, fingerprint: str, oracle: OracleResult | None, error: str, dtypes: Mapping) -> StoredOracle:
        if oracle is None:
            return cls(fingerprint, error=error or "the oracle failed")
        # float32 keeps 7 digits: enough below the float32 tolerances (1e-4, 1e-3), not below float64's
        single = {x: np.dtype(dtypes.get(x, np.float64)) != np.float64 for x in oracle.details}
        return cls(fingerprint, oracle.backend, oracle.weak, oracle.f0, None, dict(oracle.details), single)

    def covers(self, inputs: Iterable[str]) -> bool:
        return self.error is not None or all(x in self.details for x in inputs)

    def oracle(self) -> OracleResult | None:
        if self.error is not None:
            return None
        return OracleResult({x: d.value for x, d in self.details.items()}, details=self.details,
                            backend=self.backend, weak=self.weak, f0=self.f0)


class References:
    """Stored oracle answers keyed by (case, onnx version, seed), in one compressed ``.npz``.

    The file holds a JSON index (``index.json``, as bytes) and six flat arrays shared by all
    entries: ``index`` (evaluated flat coordinates, delta-encoded uint32; absent when every
    coordinate was evaluated), ``flags`` (uint8 bits: kink, unstable, discontinuous, nonfinite,
    shape_changed, one_sided), ``value32``/``value64`` (the central estimates of evaluated coordinates,
    float32 where the checked gradient is float32 or float16) and ``lower``/``upper`` (the
    one-sided slopes at kinks, float64). Loading needs no pickle.
    """

    def __init__(self, entries: Mapping[tuple[str, str, int], StoredOracle] | None = None, meta=None) -> None:
        self.entries: dict[tuple[str, str, int], StoredOracle] = dict(entries or {})
        self.meta: dict = dict(meta or {})

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, case: str, seed: int = 0, onnx_version: str | None = None) -> StoredOracle | None:
        return self.entries.get((case, onnx_version or onnx.__version__, seed))

    def put(self, case: str, entry: StoredOracle, seed: int = 0, onnx_version: str | None = None) -> None:
        self.entries[(case, onnx_version or onnx.__version__, seed)] = entry

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        arrays = {k: [] for k in ("index", "flags", "value32", "value64", "lower", "upper")}
        sizes = dict.fromkeys(arrays, 0)

        def add(kind: str, values: np.ndarray) -> list[int]:
            arrays[kind].append(values)
            sizes[kind] += len(values)
            return [sizes[kind] - len(values), len(values)]

        entries = []
        for (case, version, seed), entry in sorted(self.entries.items()):
            item = {"case": case, "onnx": version, "seed": seed, "fingerprint": entry.fingerprint}
            if entry.error is not None:
                item["error"] = entry.error
            else:
                item.update(backend=entry.backend, weak=entry.weak, f0=entry.f0, inputs={})
                for x, detail in entry.details.items():
                    item["inputs"][x] = _stored_input(detail, entry.float32.get(x, False), add)
            entries.append(item)
        dtypes = {"index": np.uint32, "flags": np.uint8, "value32": np.float32, "value64": np.float64,
                  "lower": np.float64, "upper": np.float64}
        flat = {k: np.concatenate(v).astype(dtypes[k]) if v else np.zeros(0, dtypes[k]) for k, v in arrays.items()}
        index = {"format": _REFERENCE_FORMAT, **self.meta, "entries": entries}
        flat["index.json"] = np.frombuffer(json.dumps(index, separators=(",", ":")).encode(), np.uint8)
        path.parent.mkdir(parents=True, exist_ok=True)
        buffer = io.BytesIO()
        np.savez_compressed(buffer, **flat)
        write_atomically(path, buffer.getvalue())
        return path

    @classmethod
    def load(cls, path: str | Path) -> References:
        with np.load(path, allow_pickle=False) as data:
            flat = {k: data[k] for k in data.files}
        index = json.loads(flat.pop("index.json").tobytes().decode())
        if index.get("format") != _REFERENCE_FORMAT:
            raise ValueError(f"{path}: unknown references format {index.get('format')!r}")
        meta = {k: v for k, v in index.items() if k not in ("format", "entries")}
        take = lambda kind, span: flat[kind][span[0]: span[0] + span[1]]  # noqa: E731
        entries = {}
        for item in index["entries"]:
            key = (item["case"], item["onnx"], item["seed"])
            if "error" in item:
                entries[key] = StoredOracle(item["fingerprint"], error=item["error"])
                continue
            details = {x: _loaded_input(stored, take) for x, stored in item["inputs"].items()}
            entries[key] = StoredOracle(item["fingerprint"], item["backend"], item["weak"], item["f0"], None, details)
        return cls(entries, meta)


def _stored_input(detail: FDGradient, float32: bool, add) -> dict:
    """One input's index entry. Its evaluated coordinates' flags, values (float32 when ``float32``
    and they fit) and kink bounds go to the flat arrays through ``add(kind, values) -> span``."""
    evaluated = np.flatnonzero(detail.evaluated.reshape(-1))
    value = detail.value.reshape(-1)[evaluated]
    flags = np.zeros(len(evaluated), np.uint8)
    for bit, name in enumerate(_FLAGS):
        flag = getattr(detail, name)
        if flag is not None:
            flags |= flag.reshape(-1)[evaluated].astype(np.uint8) << bit
    kinks = evaluated[detail.kink.reshape(-1)[evaluated]]
    finite = value[np.isfinite(value)]
    single = float32 and (finite.size == 0 or np.abs(finite).max() < 1e37)
    stored = {"shape": list(detail.value.shape), "flags": add("flags", flags)}
    if len(evaluated) != detail.value.size:
        stored["index"] = add("index", np.diff(evaluated, prepend=0).astype(np.uint32))
    kind = "value32" if single else "value64"
    stored[kind] = add(kind, value.astype(np.float32 if single else np.float64))
    stored["lower"] = add("lower", detail.lower.reshape(-1)[kinks])
    add("upper", detail.upper.reshape(-1)[kinks])  # the same span as lower's
    return stored


def _loaded_input(stored: Mapping, take) -> FDGradient:
    """The FDGradient of one input from its index entry and ``take(kind, span)`` of the flat arrays."""
    shape = tuple(stored["shape"])
    size = int(np.prod(shape, dtype=np.int64))
    flags = take("flags", stored["flags"])
    evaluated = (np.cumsum(take("index", stored["index"]), dtype=np.int64) if "index" in stored
                 else np.arange(size))
    kind = "value32" if "value32" in stored else "value64"
    value = np.full(size, np.nan)
    value[evaluated] = take(kind, stored[kind])
    masks = {}
    for bit, name in enumerate(_FLAGS):
        mask = np.zeros(size, bool)
        mask[evaluated] = (flags >> bit) & 1
        masks[name] = mask.reshape(shape)
    lower, upper = value.copy(), value.copy()
    kinks = evaluated[masks["kink"].reshape(-1)[evaluated]]
    lower[kinks] = take("lower", stored["lower"])
    upper[kinks] = take("upper", stored["lower"])
    mask = np.zeros(size, bool)
    mask[evaluated] = True
    return FDGradient(value=value.reshape(shape), lower=lower.reshape(shape),
                      upper=upper.reshape(shape), evaluated=mask.reshape(shape), **masks)



def is_stale(stored: StoredOracle, references: References, feeds: Mapping[str, np.ndarray]) -> bool:
    """Whether a stored answer predates the float32 fallback's widening of half-precision models
    (before ORACLE_REVISION 2 that fallback differentiated float16 models in float16: noise)."""
    half = any(np.asarray(v).dtype == np.float16 or np.asarray(v).dtype.name == "bfloat16" for v in feeds.values())
    return half and stored.backend == "float32" and references.meta.get("oracle_revision", 1) < 2

