"""The cases: single-node and expanded-function cases of onnx's backend test data (seeded and cached
per onnx version), the weight-carrying pytorch-converted/pytorch-operator models, and selecting
among them by op type and name."""

from __future__ import annotations

import dataclasses
import difflib
import glob
import os
import pickle
import re
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from onnx_autodiff.conformance.evaluator import Evaluator
from onnx_autodiff.files import write_atomically
from onnx_autodiff.commands import UsageError  # the command line's: bad input, one line, exit 2

CHECKED_ELEM_TYPES = {TensorProto.FLOAT16, TensorProto.FLOAT, TensorProto.DOUBLE}
"""The element types of the values whose gradients are checked."""

MODEL_SUITES = ("pytorch-converted", "pytorch-operator")


@dataclasses.dataclass
class Case:
    """One model with inputs. ``op`` is the op under test (the suite name for whole models);
    ``kind`` is "node", "expanded" or "model"; ``base`` holds the single-node model whose rule
    decides the differentiable inputs of an expanded case."""

    name: str
    op: str
    kind: str
    model: bytes
    inputs: dict
    base: bytes | None = None
    wrt: list | None = None  # the inputs to check, when given explicitly (second-order cases)

    def proto(self) -> onnx.ModelProto:
        return onnx.load_from_string(self.model)


def cache_dir() -> Path:
    """Where collected cases are cached: $ONNX_AUTODIFF_CACHE or ~/.cache/onnx-autodiff."""
    return Path(os.environ.get("ONNX_AUTODIFF_CACHE") or Path.home() / ".cache" / "onnx-autodiff")


def _as_input(value):
    if isinstance(value, TensorProto):
        return numpy_helper.to_array(value)
    if isinstance(value, np.generic):
        return np.asarray(value)
    return value


def _collect_node_cases() -> list[Case]:
    from onnx.backend.test.case.node import collect_testcases

    state = np.random.get_state()
    try:
        np.random.seed(0)
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")
            collected = collect_testcases(None)
    finally:
        np.random.set_state(state)
    singles = {c.name: c for c in collected if "_expanded" not in c.name}
    cases = []
    for test in collected:
        base_name = re.sub(r"_expanded(_ver\d+)?$", "", test.name)
        base = singles.get(base_name)
        if base is None or len(base.model.graph.node) != 1:
            continue
        model = test.model
        inputs = [_as_input(v) for v in test.data_sets[0][0]]
        names = [i.name for i in model.graph.input]
        cases.append(
            Case(
                name=test.name,
                op=base.model.graph.node[0].op_type,
                kind="node" if test is base else "expanded",
                model=model.SerializeToString(),
                inputs=dict(zip(names, inputs)),
                base=None if test is base else base.model.SerializeToString(),
            )
        )
    return cases


def load_node_cases(refresh: bool = False) -> list[Case]:
    """The backend node test cases (seeded with ``np.random.seed(0)``), cached per onnx version."""
    path = cache_dir() / f"backend-node-cases-onnx{onnx.__version__}-numpy{np.__version__}.pkl"
    if path.exists() and not refresh:
        try:
            with open(path, "rb") as f:
                return [Case(**fields) for fields in pickle.load(f)]
        except Exception:  # noqa: BLE001 - a corrupt or outdated cache is rebuilt
            pass
    cases = _collect_node_cases()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # plain dicts: the cache must not depend on the module's import name (__main__)
        write_atomically(path, pickle.dumps([dataclasses.asdict(c) for c in cases], protocol=pickle.HIGHEST_PROTOCOL))
    except OSError:
        pass  # no writable cache: collect again next time
    return cases


def _runs_on_onnxruntime(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray]) -> bool:
    try:
        Evaluator(model, backends=("onnxruntime",))(feeds)
        return True
    except Exception:  # noqa: BLE001 - load or run failure alike
        return False


def load_model_cases(suites: Sequence[str] = MODEL_SUITES) -> list[Case]:
    """Models of the onnx wheel's pytorch-converted/pytorch-operator data with float initializers.

    A model onnxruntime cannot run, or older than opset 7, is converted to opset 13 first.
    """
    root = Path(onnx.__file__).parent / "backend" / "test" / "data"
    cases = []
    for suite in suites:
        for path in sorted(glob.glob(str(root / suite / "*" / "model.onnx"))):
            model = onnx.load(path)
            if not any(t.data_type in CHECKED_ELEM_TYPES for t in model.graph.initializer):
                continue
            initializers = {t.name for t in model.graph.initializer}
            names = [i.name for i in model.graph.input if i.name not in initializers]
            files = sorted(
                glob.glob(os.path.join(os.path.dirname(path), "test_data_set_0", "input_*.pb")),
                key=lambda p: int(re.findall(r"\d+", os.path.basename(p))[0]),
            )
            inputs = {n: numpy_helper.to_array(onnx.load_tensor(f)) for n, f in zip(names, files)}
            model = _runnable(model, inputs)
            name = f"{suite}/{os.path.basename(os.path.dirname(path))}"
            cases.append(Case(name, suite, "model", model.SerializeToString(), inputs))
    return cases


def _runnable(model: onnx.ModelProto, inputs: Mapping[str, np.ndarray]) -> onnx.ModelProto:
    """The model, converted to opset 13 when it is older than opset 7 or onnxruntime cannot run it."""
    default_opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    # onnxruntime has no kernels for many opset-6 ops that backward graphs use (Sub, Less):
    # such models are converted too, as the ones it cannot run at all.
    if default_opset >= 7 and _runs_on_onnxruntime(model, inputs):
        return model
    try:
        return onnx.version_converter.convert_version(model, 13)
    except Exception:  # noqa: BLE001 - keep the original; the case reports the failure
        return model



def elem_type(value_info) -> int:
    """The element type of a tensor-typed ValueInfoProto (0 for other types)."""
    return value_info.type.tensor_type.elem_type if value_info.type.HasField("tensor_type") else 0


def select_cases(cases: Sequence[Case], ops: Sequence[str] = (), names: Sequence[str] = (), limit: int | None = None) -> list[Case]:
    """Filter by op type and case name (UsageError on unknown ones), then keep the first ``limit``."""
    known_ops = sorted({c.op for c in cases})
    for op in ops:
        if op not in known_ops:
            close = difflib.get_close_matches(op, known_ops, n=3)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise UsageError(f"unknown op '{op}': no backend test case exercises it{hint}")
    by_name = {c.name: c for c in cases}
    short = {c.name.split("/", 1)[1]: c.name for c in cases if c.kind == "model"}
    wanted = []
    for name in names:
        full = name if name in by_name else short.get(name)
        if full is None:
            close = difflib.get_close_matches(name, list(by_name), n=3)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise UsageError(f"unknown case '{name}'{hint}")
        wanted.append(full)
    selected = [c for c in cases if (not ops or c.op in ops) and (not names or c.name in wanted)]
    return selected[:limit] if limit is not None else selected

