"""The ``onnx-autodiff`` command line: grad, jvp, hvp, jacobian, check, artifacts, train, params, ops, demo, conformance."""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import sys
import time
from collections.abc import Sequence

import onnx_ir as ir

from onnx_autodiff.commands import (
    CHECK_OUTPUT_HELP,
    EXTERNAL_DATA_HELP,
    NO_UPGRADE_HELP,
    CommandError,
    UsageError,
    check_output_path,
    collector_paused,
    count,
    load_model,
    note_left_out,
    positive_int,
    progress_bar,
    save_output,
    write_file,
)
from onnx_autodiff.errors import AutodiffError, UnknownValueError, names_summary
from onnx_autodiff.modelfile import (
    needs_external_data,
    tensor_bytes,
    to_inline_proto,
)
from onnx_autodiff.passes import progress
from onnx_autodiff.passes.rewrite_rules.lowering import DEFAULT_TARGET as DEFAULT_LOWERING
from onnx_autodiff.passes.rewrite_rules.lowering import TARGETS as LOWERING_TARGETS

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, no usage dump
        raise UsageError(message)


def _single_output(model: ir.Model) -> str:
    outputs = [v.name for v in model.graph.outputs]
    if len(outputs) != 1:
        raise UsageError(f"the model has {len(outputs)} outputs {outputs}: choose one with --of")
    return outputs[0]


def cmd_grad(args) -> int:
    from onnx_autodiff.passes import AutodiffPass, cleanup_passes
    from onnx_autodiff.passes.parameters import quantized_weights

    check_output_path(args.output)
    model = load_model(args.model)
    forward_nodes = sum(len(graph) for graph in model.graphs())  # (subgraphs' nodes included)
    of = args.of or _single_output(model)
    quantized = quantized_weights(model.graph)
    start = time.perf_counter()
    autodiff = AutodiffPass(of=of, wrt=args.wrt or None, upgrade_opset=not args.no_upgrade)
    target = None if args.target == "none" else args.target
    passes = [autodiff] if args.no_cleanup else [autodiff, *cleanup_passes(outline=args.outline, target=target)]
    with progress_bar():
        result = ir.passes.PassManager(passes)(model)
        seconds = time.perf_counter() - start
        progress.report("writing", 0, 1)
        data = save_output(result.model, args.output, args.external_data, args.check_output)
    # The manager returns a PassResult of its own: the pass keeps its AutodiffResult.
    differentiated = autodiff.last_result
    note_left_out(differentiated.left_out, quantized_names=quantized)
    gradients = list(differentiated.gradient_names.values())
    seed = f"; seed input '{differentiated.seed_name}'" if differentiated.seed_name else ""
    print(
        # (a total, not forward + backward: the cleanup may fold forward nodes, e.g. Constants)
        f"wrote {args.output}{data}: {count(sum(len(g) for g in result.model.graphs()), 'node')} from a forward of "
        f"{forward_nodes} in {seconds:.2f} s; {count(len(gradients), 'gradient output')} "
        f"{names_summary(gradients)}{seed}"
    )
    return EXIT_OK


def cmd_transform(args) -> int:
    from onnx_autodiff.passes import transforms
    from onnx_autodiff.passes.parameters import quantized_weights

    passes = {"jvp": transforms.JvpPass, "hvp": transforms.HvpPass, "jacobian": transforms.JacobianPass}
    check_output_path(args.output)
    model = load_model(args.model)
    of = args.of or _single_output(model)
    options = {"chunk": args.chunk} if args.command == "jacobian" else {}
    transform = passes[args.command](of, args.wrt or None, upgrade_opset=not args.no_upgrade, **options)
    quantized = quantized_weights(model.graph)
    start = time.perf_counter()
    result = transform(model)
    seconds = time.perf_counter() - start
    data = save_output(result.model, args.output, args.external_data, args.check_output)
    note_left_out(result.left_out, quantized_names=quantized)
    outputs, inputs = list(result.output_names.values()), list(result.input_names.values())
    added = f"; {count(len(inputs), 'input')} {names_summary(inputs)}" if inputs else ""
    print(f"wrote {args.output}{data} in {seconds:.2f} s: {count(len(outputs), 'output')} {names_summary(outputs)}{added}")
    return EXIT_OK


def cmd_check(args) -> int:
    import numpy as np

    from onnx_autodiff.conformance.gradcheck import check_grads

    model = load_model(args.model)
    if needs_external_data(model):  # the oracle runs the model from one serialised message
        raise CommandError(f"check runs {args.model} from one protobuf message, at most 2 GB, and its tensors take "
                           f"{tensor_bytes(model) / 1e9:.2f} GB: check a smaller model with the same operators")
    proto = to_inline_proto(model)
    feeds = None
    if args.inputs:
        try:
            with np.load(args.inputs) as data:
                feeds = {k: data[k] for k in data.files}
        except (OSError, ValueError) as error:
            raise UsageError(f"cannot read inputs from {args.inputs}: {error}") from error
    report = check_grads(proto, of=args.of, wrt=args.wrt, order=args.order, feeds=feeds, seed=args.seed)
    print(report)
    return EXIT_OK if report.ok else EXIT_FAILED


def cmd_demo(args) -> int:
    from onnx_autodiff.demo import run_demo, write_example
    from onnx_autodiff.training import run_training_demo

    if args.write_example is not None:
        try:
            paths = write_example(args.write_example)
        except OSError as error:
            raise CommandError(f"cannot write the example to {args.write_example}: {error.strerror or error}") from error
        print(f"wrote {', '.join(paths)}")
        return EXIT_OK
    gradients = run_demo(steps=args.steps)
    print()
    return gradients or run_training_demo()


def operator_table() -> str:
    """Markdown list of the registry's operators: differentiable inputs, then declared non-differentiable."""
    from onnx_autodiff.rules import default_registry

    registry = default_registry()
    lines = ["| domain | op type | differentiable inputs | opsets |", "|---|---|---|---|"]
    for domain, op_type in registry.op_types(differentiable=True):
        rules = [r for r in registry.rules() if (r.domain, r.op_type) == (domain, op_type) and r.backward]
        inputs = sorted({name for r in rules for name in r.differentiable})
        if any(r.captures for r in rules):
            inputs.append("the outer values its subgraphs read")
        ranges = ", ".join(_opset_range(b) for b in sorted({r.opsets for r in rules}))
        lines.append(f"| {domain or 'ai.onnx'} | {op_type} | {', '.join(inputs) or '(zero gradient)'} | {ranges} |")
    stopped = [op for _, op in registry.op_types(differentiable=False)]
    lines += ["", f"Declared non-differentiable (gradients stop there): {', '.join(stopped)}."]
    patterns = sorted(rule.name for rule in registry.patterns())
    if patterns:
        lines += ["", f"Pattern rules (a subgraph differentiated as one unit): {', '.join(patterns)}."]
    return "\n".join(lines)


def _opset_range(bounds: tuple[int, int]) -> str:
    from onnx_autodiff.rules.registry import MAX_OPSET

    low, high = bounds
    return f"{low}+" if high >= MAX_OPSET else f"{low}-{high}"


OPS_BEGIN, OPS_END = "<!-- operators:begin -->", "<!-- operators:end -->"


def cmd_params(args) -> int:
    import json

    from onnx_autodiff.passes.parameters import parameter_rows

    rows = parameter_rows(load_model(args.model))
    if args.json:
        print(json.dumps([row.to_json() for row in rows], indent=1))
        return EXIT_OK
    table = [("module parameter", "initializer", "transform", "shape", "default", "found by / why")]
    for row in rows:
        shape = "[" + ", ".join(str(d) for d in row.shape) + "]"
        default = "trained" if row.trained else "left out"
        table.append((row.name or "-", row.initializer, row.transform or "-", shape, default,
                      "; ".join(part for part in (row.found_by, row.why) if part)))
    widths = [max(len(line[i]) for line in table) for i in range(5)]
    for line in table:
        print("  ".join(cell.ljust(width) for cell, width in zip(line, widths)) + "  " + line[5])
    parameters = [row for row in rows if row.name is not None]
    quantized = sum(row.name is None and row.why.startswith("quantized weight") for row in rows)
    frozen = f", {count(quantized, 'quantized weight')}" if quantized else ""
    print(f"{count(len(parameters), 'module parameter')} ({sum(r.trained for r in parameters)} trained by default), "
          f"{count(len(rows) - len(parameters) - quantized, 'float constant')}{frozen}")
    return EXIT_OK


def cmd_ops(args) -> int:
    table = operator_table()
    if args.update is None:
        print(table)
        return EXIT_OK
    try:
        with open(args.update, encoding="utf-8") as stream:
            text = stream.read()
    except OSError as error:
        raise UsageError(f"cannot read {args.update}: {error.strerror}") from error
    if OPS_BEGIN not in text or OPS_END not in text:
        raise UsageError(f"{args.update} has no {OPS_BEGIN} ... {OPS_END} section")
    head, rest = text.split(OPS_BEGIN, 1)
    tail = rest.split(OPS_END, 1)[1]
    write_file(args.update, f"{head}{OPS_BEGIN}\n{table}\n{OPS_END}{tail}".encode("utf-8"))
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    from onnx_autodiff import training
    from onnx_autodiff.training import train_command

    parser = _Parser(prog="onnx-autodiff", description=__doc__)
    commands = parser.add_subparsers(dest="command", parser_class=_Parser)
    grad = commands.add_parser("grad", help="append gradient outputs to a model")
    grad.add_argument("model", help="input .onnx file")
    grad.add_argument("-o", "--output", required=True, help="where to write the model with gradients")
    grad.add_argument("--of", help="the value to differentiate (default: the single graph output)")
    grad.add_argument("--wrt", nargs="+", help="variables (default: the float initializers that are not constants)")
    grad.add_argument("--no-cleanup", action="store_true", help="skip the cleanup passes")
    grad.add_argument("--target", choices=[*LOWERING_TARGETS, "none"], default=DEFAULT_LOWERING,
                      help="the runtime the cleanup lowers the graph for (webgpu: onnxruntime-web's WebGPU "
                           "provider; none: canonical standard forms)")
    grad.add_argument("--no-upgrade", action="store_true", help=NO_UPGRADE_HELP)
    grad.add_argument("--outline", action="store_true",
                      help="group each rule's backward nodes into one call of a model-local function")
    grad.add_argument("--external-data", action="store_true", help=EXTERNAL_DATA_HELP)
    grad.add_argument("--check-output", action="store_true", help=CHECK_OUTPUT_HELP)
    grad.set_defaults(run=cmd_grad)
    for name, meaning in (
        ("jvp", "add tangent inputs t_<x> and the output jvp_<of> (forward mode)"),
        ("hvp", "add direction inputs v_<x> and outputs hvp_<x> (Hessian-vector products)"),
        ("jacobian", "add outputs jac_<x> holding the full Jacobian of --of"),
    ):
        transform = commands.add_parser(name, help=meaning)
        transform.add_argument("model", help="input .onnx file")
        transform.add_argument("-o", "--output", required=True, help="where to write the result")
        transform.add_argument("--of", help="the value to differentiate (default: the single output)")
        transform.add_argument("--wrt", nargs="+", help="variables (default: the float initializers that are not constants)")
        transform.add_argument("--no-upgrade", action="store_true", help=NO_UPGRADE_HELP)
        transform.add_argument("--external-data", action="store_true", help=EXTERNAL_DATA_HELP)
        transform.add_argument("--check-output", action="store_true", help=CHECK_OUTPUT_HELP)
        if name == "jacobian":
            transform.add_argument("--chunk", type=positive_int, default=1, help="VJPs per loop iteration")
        transform.set_defaults(run=cmd_transform)
    check = commands.add_parser("check", help="check a model's derivatives against finite differences")
    check.add_argument("model", help="input .onnx file")
    check.add_argument("--of", help="the value to differentiate (default: the single output)")
    check.add_argument("--wrt", nargs="+", help="variables (default: float initializers, else float inputs)")
    check.add_argument("--order", type=int, choices=(1, 2), default=1, help="1: gradients; 2: also their derivatives")
    check.add_argument("--inputs", metavar="NPZ", help="input values (default: random floats)")
    check.add_argument("--seed", type=int, default=0)
    check.set_defaults(run=cmd_check)
    params = commands.add_parser("params", help="list the module parameters found in a model and what training does with them")
    params.add_argument("model", help="input .onnx file")
    params.add_argument("--json", action="store_true", help="one JSON list instead of the table")
    params.set_defaults(run=cmd_params)
    ops = commands.add_parser("ops", help="list the operators that have gradient rules (Markdown)")
    ops.add_argument("--update", metavar="FILE", help="rewrite the operator section of FILE (docs/operators.md)")
    ops.set_defaults(run=cmd_ops)
    demo = commands.add_parser("demo", help="differentiate, check and train an embedded classifier")
    demo.add_argument("--steps", type=int, default=60, help="training steps (default 60)")
    demo.add_argument("--write-example", metavar="DIR",
                      help="instead: write the classifier (model.onnx) and its data (train.npz, val.npz) to DIR")
    demo.set_defaults(run=cmd_demo)
    artifacts = commands.add_parser("artifacts", help="write train-step, eval and checkpoint files for plain onnxruntime")
    training.add_arguments(artifacts)
    artifacts.set_defaults(run=training.run)
    train = commands.add_parser("train", help="train a model on arrays from an .npz or .safetensors file")
    train_command.add_arguments(train)
    try:
        from onnx_autodiff.conformance import runner
    except ImportError:
        runner = None
    if runner is not None and hasattr(runner, "add_arguments"):
        conformance = commands.add_parser(
            "conformance", help="check the rules against the ONNX backend test data"
        )
        runner.add_arguments(conformance)
        conformance.set_defaults(run=runner.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    # Failed shape inference is reported by onnx-ir as a log warning; our errors say what matters.
    logging.getLogger("onnx_ir").setLevel(logging.ERROR)
    with _notes_on_stderr(logging.getLogger("onnx_autodiff")):
        code = _main(argv, program=argv is None)
    if argv is None:  # the program (not a caller's in-process call): it exits next
        # What the command built is left to the operating system: at exit Python's collector would
        # otherwise walk and free the model's objects one by one (1.3 s of the 20,001-node chain's
        # grad, 4 s of its artifacts, after the work is done).
        gc.freeze()
    return code


# Commands that build one model (or one set of artifacts): they run with Python's collector paused,
# which would rescan the large graphs while they are read, built and written (the passes leave it
# alone); run as the program, which exits next, they keep it off, so that the graphs they leave are
# never walked (a collection as the build ends costs 0.7 s for a 20,001-node chain's grad, 1.7 s for
# its artifacts).
BUILD_COMMANDS = frozenset({"grad", "jvp", "hvp", "jacobian", "artifacts"})


def _main(argv: Sequence[str] | None, program: bool = False) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        if getattr(args, "run", None) is None:
            raise UsageError("choose a command: " + ", ".join(_commands(parser)))
        building = args.command in BUILD_COMMANDS
        if program and building:
            gc.disable()  # (for good: main freezes what is left, and the program exits)
        try:
            with collector_paused() if building else contextlib.nullcontext():
                return args.run(args)
        except ir.passes.PassError as error:
            raise _root_cause(error) from error
    except (UsageError, UnknownValueError) as error:
        return _fail(str(error), EXIT_USAGE)
    except (AutodiffError, CommandError) as error:
        return _fail(str(error), EXIT_FAILED)
    except KeyboardInterrupt:
        return _fail("interrupted", 130)
    except BrokenPipeError:  # the reader went away (| head): nothing left to say
        return EXIT_OK
    except Exception as error:  # noqa: BLE001 - users get one line, never a traceback
        return _fail(f"unexpected {type(error).__name__} (please report): {error}", EXIT_FAILED)


class _NoteHandler(logging.StreamHandler):
    """Writes to the ``sys.stderr`` of the moment (a caller may have replaced it since)."""

    stream = property(lambda self: sys.stderr, lambda self, value: None)


@contextlib.contextmanager
def _notes_on_stderr(logger: logging.Logger):
    """While a command runs, the library's warnings (a model converted to a newer opset) as one
    ``note:`` line each, instead of through the caller's logging."""
    handler, propagate = _NoteHandler(), logger.propagate
    handler.setFormatter(logging.Formatter("onnx-autodiff: note: %(message)s"))
    logger.addHandler(handler)
    logger.propagate = False
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.propagate = propagate


def _root_cause(error: BaseException) -> BaseException:
    """The exception a pass raised, unwrapped from the PassManager's PassError."""
    while isinstance(error, ir.passes.PassError) and error.__cause__ is not None:
        error = error.__cause__
    return error


def _fail(message: str, code: int) -> int:
    print("onnx-autodiff: error: " + " ".join(message.split()), file=sys.stderr)
    return code


def _commands(parser: argparse.ArgumentParser) -> list[str]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return sorted(action.choices)
    return []


if __name__ == "__main__":
    sys.exit(main())
