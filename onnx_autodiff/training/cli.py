"""``onnx-autodiff artifacts`` and the training half of ``onnx-autodiff demo``."""

from __future__ import annotations

import os
import time

import numpy as np
import onnx
from onnx import helper, numpy_helper

from onnx_autodiff.commands import (CHECK_OUTPUT_HELP, NO_UPGRADE_HELP, CommandError, UsageError, non_negative_int,
                                    note_left_out, positive_int, read_model_proto)
from onnx_autodiff.errors import TrainingError, names_summary
from onnx_autodiff.training.lora import LoraConfig
from onnx_autodiff.training.qat import SCHEMES as QAT_SCHEMES
from onnx_autodiff.training.qat import QatConfig
from onnx_autodiff.weights.quantized import BLOCK_SIZES, FORMATS, KINDS
from onnx_autodiff.training.artifacts import TrainingArtifacts, generate_artifacts, quantized_weight_names
from onnx_autodiff.training.generation.config import ArtifactsConfig
from onnx_autodiff.training.losses import LOSSES, BuiltinLoss
from onnx_autodiff.training.optimizers import OPTIMIZERS
from onnx_autodiff.training.schedules import SCHEDULES, LRSchedule
from onnx_autodiff.training.targets import TARGETS
from onnx_autodiff.training.trainer import Trainer



def add_arguments(parser) -> None:
    """Arguments of ``onnx-autodiff artifacts MODEL -o DIR``."""
    parser.add_argument("model", help="forward .onnx model")
    parser.add_argument("-o", "--output", required=True, help="directory to write the artifacts to")
    add_generation_arguments(parser)
    parser.add_argument("--gradient-accumulation", action="store_true", help="also write the accumulate and apply models")
    parser.add_argument("--external-data", action="store_true",
                        help="write each model's tensors to a data file beside it, a self-contained copy (done "
                             "anyway for models over protobuf's 2 GB limit; without it, the artifacts of a model "
                             "read with external data read its data file where it is, no copy written)")
    parser.add_argument("--checkpoint-format", choices=["npz", "safetensors"], default="npz",
                        help="checkpoint.npz (default) or checkpoint.safetensors (what the JavaScript trainer reads)")
    parser.add_argument("--check-output", action="store_true", help=CHECK_OUTPUT_HELP)
    parser.add_argument("--lr-schedule", choices=SCHEDULES,
                        help="record a learning-rate schedule for the trainers: constant, or decaying linearly or "
                             "as a cosine to 0 at --total-steps, after --warmup-steps")
    parser.add_argument("--warmup-steps", type=non_negative_int, default=0, metavar="N",
                        help="raise the learning rate linearly from 0 over the first N steps (default 0)")
    parser.add_argument("--total-steps", type=positive_int, metavar="N", help="the steps of the whole run (linear and cosine)")
    parser.add_argument("--target", choices=list(TARGETS), default=ArtifactsConfig.target,
                        help="the runtime the models are lowered for: onnxruntime (default) or webgpu "
                             "(onnxruntime-web's WebGPU provider runs every compute node)")


def add_generation_arguments(parser) -> list[str]:
    """The options of :func:`generate_artifacts` (loss, optimiser, parameters, LoRA, QAT), shared by the
    ``artifacts`` and ``train`` commands; returns their destinations. Each defaults to None (or
    False), so that a command can tell which were given; :func:`artifacts_from_args` fills in the
    defaults the help names."""

    actions = [
        parser.add_argument("--loss", choices=[*LOSSES, "none"],
                            help="loss on the model's output; 'none': the model's output is the loss (default "
                                 "cross_entropy); a class loss on a Softmax/Sigmoid output applies to the logits under it"),
        parser.add_argument("--ctc-blank", type=int, metavar="INDEX", help="--loss ctc: the blank's class (default 0)"),
        parser.add_argument("--ctc-zero-infinity", action="store_true",
                            help="--loss ctc: impossible alignments (targets too long) count 0, not infinity"),
        parser.add_argument("--optimizer", choices=OPTIMIZERS, help="default adamw"),
        parser.add_argument("--requires-grad", nargs="+", metavar="NAME", help="initializers to train, by name or shell-style pattern on initializer or module parameter names, "
                                 "e.g. 'model.layers.*.mlp.*' (default: the model's parameters)"),
        parser.add_argument("--frozen", nargs="+", metavar="NAME",
                            help="initializers to keep fixed (names or patterns, as --requires-grad)"),
        parser.add_argument("--output-name", metavar="NAME", help="the model output the loss applies to (default: the first)"),
        parser.add_argument("--lr", type=float, help="learning rate (default: the optimiser's, recorded in the artifacts)"),
        parser.add_argument("--momentum", type=float, help="SGD momentum"),
        parser.add_argument("--nesterov", action="store_true", help="SGD Nesterov momentum"),
        parser.add_argument("--weight-decay", type=float, help="weight decay (AdamW: decoupled)"),
        parser.add_argument("--max-grad-norm", type=float, help="clip gradients by their global L2 norm"),
        parser.add_argument("--lora", type=int, metavar="RANK",
                            help="train LoRA adapters of this rank on the MatMul/Gemm weights instead of the weights "
                                 "(--requires-grad then names extra initializers to train)"),
        parser.add_argument("--lora-alpha", type=float, metavar="A", help="LoRA scale numerator: scale = A / RANK (default RANK)"),
        parser.add_argument("--lora-targets", nargs="+", metavar="PATTERN",
                            help="weights to adapt, shell-style patterns on initializer or module parameter names, "
                                 "e.g. '*q_proj*' (default: all)"),
        parser.add_argument("--lora-dropout", type=float, metavar="P", help="dropout on the adapters' input in training (default 0)"),
        parser.add_argument("--quantize-base", choices=KINDS,
                            help="QLoRA: store the frozen MatMul/Gemm weights quantized (int4 blocked, int8 per "
                                 "channel) or in float16; the adapters train in float"),
        parser.add_argument("--quantize-format", choices=FORMATS,
                            help="how the train models read a quantized base, stored so by --quantize-base or the "
                                 "model's own MatMulNBits: standard DequantizeLinear (default; int4 needs opset 21, "
                                 "converted; each weight held once, dequantized at each read) or onnxruntime's "
                                 "com.microsoft.MatMulNBits kernel (which keeps a pre-packed copy of its weights); "
                                 "with --qat int4-*: how the exported model stores the MatMul and Gemm weights "
                                 "(default DequantizeLinear, which onnxruntime fuses into MatMulNBits)"),
        parser.add_argument("--quantize-block", type=int, choices=BLOCK_SIZES, metavar="SIZE",
                            help="int4 block size along the reduction axis (default 32)"),
        parser.add_argument("--quantize-asymmetric", action="store_true",
                            help="unsigned values with a zero point per block/channel (default symmetric)"),
        parser.add_argument("--qat", choices=list(QAT_SCHEMES),
                            help="quantization-aware training: train through fake quantization of the Conv, "
                                 "ConvTranspose, Gemm and MatMul weights (int8 per channel, or int4) and, with int8 "
                                 "activations, of their inputs; the exported model is the quantized (QDQ) one"),
        parser.add_argument("--qat-calibration-steps", type=positive_int, metavar="N",
                            help=f"--qat: the steps the activations' ranges are observed for before they freeze "
                                 f"(default {QatConfig.calibration_steps})"),
        parser.add_argument("--qat-skip", nargs="+", metavar="PATTERN",
                            help="--qat: nodes or weights to keep in float, shell-style patterns on their names, "
                                 "e.g. '*lm_head*'"),
        parser.add_argument("--qat-asymmetric", action="store_true",
                            help="--qat: weights with a zero point per channel or block (default symmetric)"),
        parser.add_argument("--qat-learn-scales", action="store_true",
                            help="--qat: learn each scale (the observed one times exp(t), t trained by its LSQ "
                                 "gradient), so that the ranges keep adapting once the observers freeze"),
        parser.add_argument("--no-upgrade", action="store_true", help=NO_UPGRADE_HELP),
    ]
    return [action.dest for action in actions]


def artifacts_from_args(args, gradient_accumulation: bool = False, label_shape: list | None = None,
                        lr_schedule: LRSchedule | None = None) -> TrainingArtifacts:
    """The artifacts of ``args.model`` with the options of :func:`add_generation_arguments`;
    ``label_shape``: the data's labels' (it decides cross_entropy's class axis where the logits'
    shape does not)."""

    options = {k: v for k, v in (("lr", args.lr), ("momentum", args.momentum), ("weight_decay", args.weight_decay)) if v is not None}
    if args.nesterov:
        options["nesterov"] = True
    optimizer = args.optimizer or "adamw"
    if optimizer != "sgd" and ("momentum" in options or args.nesterov):
        raise TrainingError("--momentum and --nesterov apply to --optimizer sgd only")
    lora = _lora_config(args, UsageError)
    qat = _qat_config(args)
    read_model_proto(args.model)  # checked; read again from the path, which locates its external data
    loss = args.loss or "cross_entropy"
    ctc = {k: v for k, v in (("blank", args.ctc_blank), ("zero_infinity", args.ctc_zero_infinity or None)) if v is not None}
    if ctc and loss != "ctc":
        raise UsageError("--ctc-blank and --ctc-zero-infinity apply to --loss ctc only")
    config = ArtifactsConfig(
        requires_grad=args.requires_grad, frozen_params=args.frozen,
        loss=None if loss == "none" else BuiltinLoss(loss, **ctc) if ctc else loss, optimizer=optimizer,
        optimizer_options=options, labels=None if label_shape is None else [("labels", np.int64, label_shape)],
        output=args.output_name, max_grad_norm=args.max_grad_norm, gradient_accumulation=gradient_accumulation,
        upgrade_opset=not args.no_upgrade, lora=lora, target=getattr(args, "target", ArtifactsConfig.target),
        check_output=getattr(args, "check_output", False), lr_schedule=lr_schedule, qat=qat,
    )
    return generate_artifacts(args.model, config)


def _schedule(args) -> LRSchedule | None:
    """The schedule of ``--lr-schedule``, ``--warmup-steps`` and ``--total-steps`` (None: none)."""
    kind, warmup, total = args.lr_schedule, args.warmup_steps, args.total_steps
    if kind is None and not warmup and total is None:
        return None
    if kind in ("linear", "cosine") and total is None:
        raise UsageError(f"--lr-schedule {kind} decays to 0 at the run's last step: give --total-steps N")
    try:
        return LRSchedule(kind or "constant", warmup, total)
    except TrainingError as error:
        raise UsageError(str(error)) from error


def run(args) -> int:
    """``onnx-autodiff artifacts``: writes the artifacts; exit 0, or raises an AutodiffError or one of the
    command line's errors (UsageError, CommandError)."""

    if os.path.exists(args.output) and not os.path.isdir(args.output):
        raise UsageError(f"-o {args.output} is a file: name the directory to write the artifacts to")
    if args.qat is not None and args.gradient_accumulation:
        raise UsageError(f"--qat {args.qat} does not combine with --gradient-accumulation yet: the observers count "
                         "the optimiser's steps, which the accumulate model does not take")
    start = time.perf_counter()
    artifacts = artifacts_from_args(args, args.gradient_accumulation, lr_schedule=_schedule(args))
    try:
        written = artifacts.save(args.output, True if args.external_data else None, args.checkpoint_format)
    except OSError as error:  # each file is written atomically: none is half-written
        raise CommandError(f"cannot write the artifacts to {args.output}: {error.strerror or error}") from error
    seconds = time.perf_counter() - start
    note_left_out(getattr(artifacts, "left_out", []), "--requires-grad", "train",
                  quantized_weight_names(artifacts.inference_model))
    lora = artifacts.manifest.lora
    count = len(lora.adapters) if lora else 0
    adapted = f", LoRA rank {lora.config.rank} on {count} weight{'s' if count != 1 else ''}" if lora else ""
    qat = artifacts.manifest.qat
    adapted += f", QAT {qat.scheme}" if qat else ""
    module = {m.initializer: m.name for m in artifacts.manifest.modules or ()}
    names = [module.get(p, p) for p in artifacts.params]  # a folded val_29 shown as q_proj.weight
    print(
        f"wrote {len(written)} files to {args.output} in {seconds:.2f} s: {len(artifacts.params)} parameters "
        f"({names_summary(names)}){adapted}, {artifacts.optimizer.name}, train model {len(artifacts.train_model.graph.node)} nodes"
    )
    return 0


def _lora_config(args, usage_error) -> LoraConfig | None:
    """The LoRA options as a LoraConfig (None without --lora); bad values are usage errors."""
    given = [flag for flag, value in (("--lora-alpha", args.lora_alpha), ("--lora-targets", args.lora_targets),
                                      ("--lora-dropout", args.lora_dropout), ("--quantize-base", args.quantize_base),
                                      ("--quantize-format", args.quantize_format if args.qat is None else None),
                                      ("--quantize-block", args.quantize_block),
                                      ("--quantize-asymmetric", args.quantize_asymmetric or None)) if value is not None]
    if args.lora is None:
        if given:
            raise usage_error(f"{' and '.join(given)} {'needs' if len(given) == 1 else 'need'} --lora RANK")
        return None
    try:
        if args.quantize_base is None and (args.quantize_block or args.quantize_asymmetric):
            raise usage_error("--quantize-block and --quantize-asymmetric need --quantize-base")
        return LoraConfig(rank=args.lora, alpha=args.lora_alpha, targets=args.lora_targets,
                          dropout=args.lora_dropout or 0.0, quantize_base=args.quantize_base,
                          quantize_format=args.quantize_format if args.qat is None else None,
                          quantize_block=args.quantize_block or 32, quantize_symmetric=not args.quantize_asymmetric)
    except TrainingError as error:
        raise usage_error(str(error)) from error


def _qat_config(args) -> QatConfig | None:
    """The QAT options as a QatConfig (None without --qat); --qat-* without --qat is a usage error."""
    given = [flag for flag, value in (("--qat-calibration-steps", args.qat_calibration_steps),
                                      ("--qat-skip", args.qat_skip),
                                      ("--qat-asymmetric", args.qat_asymmetric or None),
                                      ("--qat-learn-scales", args.qat_learn_scales or None)) if value is not None]
    if args.qat is None:
        if given:
            raise UsageError(f"{' and '.join(given)} {'needs' if len(given) == 1 else 'need'} --qat SCHEME")
        return None
    options = {"calibration_steps": args.qat_calibration_steps} if args.qat_calibration_steps is not None else {}
    if args.quantize_format is not None:  # (with --qat, the exported model's format)
        options["quantize_format"] = args.quantize_format
    try:
        return QatConfig(args.qat, skip=tuple(args.qat_skip or ()), symmetric=not args.qat_asymmetric,
                         learn_scales=args.qat_learn_scales, **options)
    except TrainingError as error:
        raise UsageError(str(error)) from error


def run_training_demo(steps: int = 150, out=print) -> int:
    """Builds artifacts for an MLP with BatchNormalization and Dropout, trains it with AdamW on
    onnxruntime, exports it and checks the exported model's accuracy; 0 on success."""
    import onnxruntime as ort

    from onnx_autodiff.demo import CLASSES, FEATURES, blobs

    hidden = 32
    rng = np.random.default_rng(0)

    def init(name, *shape, scale=None, fill=None):
        array = np.full(shape, fill, np.float32) if fill is not None else (rng.standard_normal(shape) * scale).astype(np.float32)
        return numpy_helper.from_array(array, name)

    nodes = [
        helper.make_node("Gemm", ["X", "W1", "b1"], ["h"], transB=1),
        helper.make_node("BatchNormalization", ["h", "gamma", "beta", "mean", "var"], ["hn"]),
        helper.make_node("Relu", ["hn"], ["a"]),
        helper.make_node("Dropout", ["a", "ratio"], ["d"]),
        helper.make_node("Gemm", ["d", "W2", "b2"], ["logits"], transB=1),
    ]
    graph = helper.make_graph(
        nodes, "mlp",
        [helper.make_tensor_value_info("X", onnx.TensorProto.FLOAT, ["N", FEATURES])],
        [helper.make_tensor_value_info("logits", onnx.TensorProto.FLOAT, ["N", CLASSES])],
        [init("W1", hidden, FEATURES, scale=(2 / FEATURES) ** 0.5), init("b1", hidden, fill=0),
         init("gamma", hidden, fill=1), init("beta", hidden, fill=0), init("mean", hidden, fill=0),
         init("var", hidden, fill=1), numpy_helper.from_array(np.array(0.1, np.float32), "ratio"),
         init("W2", CLASSES, hidden, scale=(1 / hidden) ** 0.5), init("b2", CLASSES, fill=0)],
    )
    forward = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)
    start = time.perf_counter()
    artifacts = generate_artifacts(forward, loss="cross_entropy", optimizer="adamw", optimizer_options={"lr": 1e-2})
    build = time.perf_counter() - start
    X, labels = blobs(seed=1, samples=512)
    Xt, lt = blobs(seed=1, samples=768)
    Xt, lt = Xt[512:], lt[512:]
    trainer = Trainer(artifacts)
    before = trainer.evaluate({"X": Xt, "labels": lt})
    start = time.perf_counter()
    for i in range(steps):
        rows = slice((i * 64) % 512, (i * 64) % 512 + 64)
        loss = trainer.step({"X": X[rows], "labels": labels[rows]})
    seconds = time.perf_counter() - start
    after = trainer.evaluate({"X": Xt, "labels": lt})
    exported = trainer.export()
    session = ort.InferenceSession(exported.SerializeToString(), providers=["CPUExecutionProvider"])
    logits = session.run(None, {"X": Xt})[0]
    accuracy = float(np.mean(logits.argmax(1) == lt))
    same = np.allclose(logits, after["logits"], atol=1e-5)
    out("onnx-autodiff training demo: MLP 16-32-4 with BatchNormalization and Dropout, AdamW, plain onnxruntime")
    out(f"  artifacts      train {len(artifacts.train_model.graph.node)} nodes, eval {len(artifacts.eval_model.graph.node)} nodes, built in {build:.2f} s")
    out(f"  training       {steps} steps of 64 in {seconds:.2f} s ({seconds / steps * 1e3:.2f} ms/step), last loss {loss:.4f}")
    out(f"  held-out loss  {float(before['loss']):.4f} -> {float(after['loss']):.4f}")
    out(f"  exported model accuracy {accuracy:.1%} (matches eval model: {same})")
    ok = float(after["loss"]) < float(before["loss"]) and accuracy > 0.8 and same
    out("  result         " + ("ok" if ok else "FAILED"))
    return 0 if ok else 1
