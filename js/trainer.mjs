// Runs onnx-autodiff training artifacts on onnxruntime-js: the same module in Node (onnxruntime-node)
// and in the browser (onnxruntime-web), which pass their `ort` in. The train-step model takes
// [batch, parameters, optimiser state, buffers, lr, step, coefficients] and returns [loss, new
// parameters, new state, new buffers]; artifacts.json names them ("train": batch, carry [key,
// input, output], reads, scalars, coefficients, loss: docs/artifacts.md describes the format,
// artifacts.schema.json is its JSON Schema, which validate.mjs checks). Parameters and state stay
// onnxruntime tensors from step to step: the outputs of step k are the inputs of step k + 1. The
// coefficients (Adam's bias corrections, AdamW's decay) are scalars computed here in float64 from
// lr and the step, as artifacts.json's expressions say, and fed in the input's type (float32 for a
// float32 model): the models hold no float64, which onnxruntime-web's builds cannot run.

import { parse, serialize } from "./safetensors.mjs";

export const FORMAT_VERSION = 2;
// 1: the coefficients computed in the graph, in float64; 3: the step and micro-batch fed as uint32
// inputs (the webgpu target's hashed Dropout)
export const READABLE_FORMATS = [1, 2, 3];
export const STEP_KEY = "__step__"; // the int64 scalar a checkpoint stores the number of steps taken in

export const EXTERNAL_DATA = "training_model.onnx.data";
const MODEL_FILES = {
  train: "training_model.onnx", eval: "eval_model.onnx", accumulate: "accumulate_model.onnx", apply: "apply_model.onnx",
};

export class TrainingError extends Error {}
export class BatchError extends TrainingError {}

const FLOATS = new Set(["float32", "float64", "float16"]);
const INTEGERS = new Set(["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"]);
const ARRAYS = {
  float32: Float32Array, float64: Float64Array, int8: Int8Array, int16: Int16Array, int32: Int32Array,
  int64: BigInt64Array, uint8: Uint8Array, uint16: Uint16Array, uint32: Uint32Array, uint64: BigUint64Array,
};

// The execution providers that run some nodes of the default target's models on the CPU, and the
// target that builds models they run whole (`onnx-autodiff artifacts --target`): onnxruntime-web's
// WebGPU provider has no LogSoftmax or Sum of the kind the onnxruntime target keeps.
const PROVIDER_TARGETS = { webgpu: "webgpu" };

/** The one line that says artifacts open on a provider they were not built for, or undefined. */
export function targetNote(layout, executionProviders = []) {
  const built = layout.target === undefined ? "onnxruntime" : layout.target; // (artifacts.json leaves out the default)
  for (const provider of executionProviders) {
    const name = typeof provider === "string" ? provider : provider?.name;
    const wanted = PROVIDER_TARGETS[name];
    if (wanted !== undefined && wanted !== built) {
      return `trainer.mjs: note: these artifacts were built for target ${JSON.stringify(built)}, not for the ${name} `
        + `execution provider, which runs some of their nodes on the CPU: generate them with --target ${wanted}`;
    }
  }
  return undefined;
}

const firstLine = (error) => String(error?.message ?? error).trim().split("\n")[0] || String(error?.name);
const shapeText = (dims) => `[${dims.map((d) => (typeof d === "number" && d >= 0 ? d : d || "?")).join(", ")}]`;

/** Whether every element of a float tensor is finite (float16 read from its bits); true for other types. */
export function allFinite(tensor) {
  const { type, data } = tensor;
  if (type === "float16") return data.every((bits) => (bits & 0x7c00) !== 0x7c00);
  return !FLOATS.has(type) || data.every(Number.isFinite);
}

// The operators of the layout's coefficient expressions, in float64 (as Python's float and C's pow).
const OPERATORS = {
  "+": (a, b) => a + b, "-": (a, b) => a - b, "*": (a, b) => a * b, "/": (a, b) => a / b,
  pow: Math.pow, sqrt: Math.sqrt, float32: Math.fround,
};

/** The value of a coefficient expression of artifacts.json: a number, a name of `values` ("lr",
 * "step") or [operator, ...operands]. */
export function evaluateCoefficient(expression, values) {
  if (typeof expression === "number") return expression;
  if (typeof expression === "string") {
    if (!(expression in values)) throw new TrainingError(`a coefficient reads '${expression}', which the trainer does not give`);
    return Number(values[expression]);
  }
  if (!Array.isArray(expression) || !(expression[0] in OPERATORS)) {
    throw new TrainingError(`unknown coefficient expression ${JSON.stringify(expression)}: the artifacts need a newer trainer`);
  }
  const [operator, ...operands] = expression;
  return OPERATORS[operator](...operands.map((x) => evaluateCoefficient(x, values)));
}

/** A scalar tensor of `type` holding `value` (rounded to the type: float32 to nearest). */
function scalarTensor(ort, type, value, name) {
  if (type === "int64") return new ort.Tensor("int64", BigInt64Array.of(BigInt(value)), []);
  if (["float32", "float64", "int32", "uint32"].includes(type)) return new ort.Tensor(type, ARRAYS[type].of(value), []);
  throw new TrainingError(`the model's scalar input '${name}' is ${type}: this trainer feeds float32, float64, int32, uint32 and int64 scalars`);
}

/** Rows [start, end) of each tensor of {name: tensor} along the first axis (views, no copy). */
export function sliceRows(tensors, start, end) {
  const rows = {};
  for (const [name, { type, dims, data }] of Object.entries(tensors)) {
    const width = dims.slice(1).reduce((n, d) => n * d, 1);
    rows[name] = { type, dims: [end - start, ...dims.slice(1)], data: data.subarray(start * width, end * width) };
  }
  return rows;
}

/** The common first dimension of the tensors of {name: tensor} (an error when they differ). */
export function rowCount(tensors) {
  const counts = Object.entries(tensors).map(([name, t]) => [name, t.dims.length ? t.dims[0] : undefined]);
  const [name, rows] = counts[0] ?? [];
  const other = counts.find(([, n]) => n !== rows);
  if (rows === undefined || other) {
    throw new BatchError(other ? `'${other[0]}' has ${other[1] ?? "no"} rows and '${name}' ${rows}: every array needs the same first dimension`
      : `'${name}' is a scalar: the data needs arrays of examples`);
  }
  return rows;
}

/** `tensor` converted to `type` within its kind (float to float, integer to integer), as numpy's same_kind cast. */
function converted(name, tensor, type) {
  if (tensor.type === type) return tensor;
  const kind = (t) => (FLOATS.has(t) ? "float" : INTEGERS.has(t) ? "integer" : t);
  if (kind(tensor.type) !== kind(type) || !ARRAYS[type] || !ARRAYS[tensor.type]) {
    throw new BatchError(`batch input '${name}' is ${tensor.type}; the model expects ${type}`);
  }
  const cast = type.endsWith("int64") ? BigInt : tensor.type.endsWith("int64") ? Number : undefined;
  return { type, dims: tensor.dims, data: ARRAYS[type].from(tensor.data, cast) };
}

class Runner {
  // One model's session and the names of its inputs and outputs ("train" or "eval" layout).
  constructor(session, layout, kind) {
    this.session = session;
    this.layout = layout;
    this.kind = kind;
    this.meta = Object.fromEntries((session.inputMetadata ?? []).map((m) => [m.name, m]));
  }

  /** The batch {name: tensor} as the model's feeds, checked against its declared types and shapes. */
  feeds(ort, batch) {
    const names = this.layout.batch;
    const missing = names.filter((n) => !(n in batch));
    const unknown = Object.keys(batch).filter((n) => !names.includes(n)).sort();
    if (missing.length || unknown.length) {
      throw new BatchError(`the ${this.kind} model takes the batch inputs ${JSON.stringify(names)}`
        + (missing.length ? `; missing ${JSON.stringify(missing)}` : "") + (unknown.length ? `; unknown ${JSON.stringify(unknown)}` : ""));
    }
    const sizes = {};
    const feeds = {};
    for (const name of names) {
      const meta = this.meta[name];
      const tensor = meta?.isTensor ? converted(name, batch[name], meta.type) : batch[name];
      const dims = Array.from(tensor.dims);
      const want = meta?.isTensor ? meta.shape : undefined;
      if (want?.length) { // onnxruntime gives [] for a scalar and for an unknown shape alike
        if (dims.length !== want.length) {
          throw new BatchError(`batch input '${name}' has shape ${shapeText(dims)}; the model expects rank ${want.length} ${shapeText(want)}`);
        }
        want.forEach((size, axis) => {
          if (typeof size === "number" && size >= 0 && size !== dims[axis]) {
            throw new BatchError(`batch input '${name}' has shape ${shapeText(dims)}; the model expects ${shapeText(want)} (axis ${axis} must be ${size})`);
          }
          if (typeof size === "string" && size) {
            const seen = (sizes[size] ??= [dims[axis], name]);
            if (seen[0] !== dims[axis]) {
              throw new BatchError(`batch input '${name}' has shape ${shapeText(dims)}, but its axis ${axis} (${size}) must match '${seen[1]}', where ${size} = ${seen[0]}`);
            }
          }
        });
      }
      if (dims.length && dims[0] === 0) {
        throw new BatchError(`batch input '${name}' has shape ${shapeText(dims)}: the batch is empty; the ${this.kind} model needs at least one example`);
      }
      feeds[name] = tensor instanceof ort.Tensor ? tensor : new ort.Tensor(tensor.type, tensor.data, dims);
    }
    return feeds;
  }

  async run(feeds) {
    try {
      return await this.session.run(feeds);
    } catch (error) {
      throw new TrainingError(`the ${this.kind} step failed on onnxruntime; nothing was updated: ${firstLine(error)}`);
    }
  }
}

/**
 * The factor of the learning rate for the optimiser step after `step` steps, under artifacts.json's
 * `lr_schedule` ({kind, warmup_steps, total_steps}; null: 1), as training/schedules.py computes it
 * (transformers' get_scheduler formulas).
 */
export function scheduleFactor(schedule, step) {
  if (!schedule) return 1;
  const { kind, warmup_steps: warmup = 0, total_steps: total } = schedule;
  if (step < warmup) return step / Math.max(1, warmup);
  if (kind === "constant") return 1;
  const remaining = Math.max(1, total - warmup);
  if (kind === "linear") return Math.max(0, (total - step) / remaining);
  if (kind === "cosine") return Math.max(0, 0.5 * (1 + Math.cos(Math.PI * (step - warmup) / remaining)));
  throw new TrainingError(`artifacts.json: unknown learning-rate schedule ${JSON.stringify(kind)}`);
}

/**
 * Trains from an artifacts directory. `Trainer.open(ort, read, options)` reads it through
 * `read(name)`, a function returning the bytes of a file of the directory (a Uint8Array) or null
 * when there is none: fs.readFile in Node, fetch in the browser.
 *
 * options: lr (default: the optimiser's, from artifacts.json), nonfinite ("raise", the default, or
 * "skip"), checkpoint ({name: tensor}, e.g. safetensors' parse(bytes).tensors; default: the
 * directory's checkpoint.safetensors), sessionOptions (for onnxruntime's InferenceSession.create).
 *
 * `step(batch)` takes one optimiser step; `accumulate(batch)` and `apply()` take one in
 * micro-batches (artifacts built with gradient_accumulation: the accumulate model sums the
 * gradients, the apply model updates with their mean), as the Python Trainer's methods of the
 * same names do.
 *
 * A step whose loss or update is not finite keeps nothing: it throws a TrainingError naming the
 * step, or with nonfinite "skip" counts it in skippedSteps (not in stepCount), as the Python
 * Trainer does; a micro-batch that is not finite makes apply() skip its whole step.
 */
export class Trainer {
  static async open(ort, read, options = {}) {
    const text = await read("artifacts.json");
    if (!text) throw new TrainingError("the directory holds no training artifacts (no artifacts.json)");
    const layout = JSON.parse(new TextDecoder().decode(text));
    if (!READABLE_FORMATS.includes(layout.format)) {
      throw new TrainingError(`artifacts.json: unsupported artifacts format ${JSON.stringify(layout.format)} (this trainer reads `
        + `formats ${READABLE_FORMATS.join(", ")}): generate the artifacts again, or use the trainer that goes with them`);
    }
    let checkpoint = options.checkpoint;
    if (!checkpoint) {
      const bytes = await read("checkpoint.safetensors");
      if (!bytes) {
        throw new TrainingError("the artifacts have no checkpoint.safetensors: save them with "
          + "TrainingArtifacts.save(directory, checkpoint_format=\"safetensors\"), or give a safetensors checkpoint");
      }
      checkpoint = parse(bytes).tensors;
    }
    const model = await read(MODEL_FILES.train);
    if (!model) throw new TrainingError(`the artifacts have no ${MODEL_FILES.train}`);
    // errors only: onnxruntime warns once per overridable initializer, which the frozen half-float
    // weights are on purpose (not folded into float copies)
    const sessionOptions = { graphOptimizationLevel: "all", logSeverityLevel: 3, ...options.sessionOptions };
    const note = targetNote(layout, sessionOptions.executionProviders);
    if (note) console.warn(note);
    // tensors the build made (a base quantized anew) are saved in the train model's data file, which
    // the other models read too: onnxruntime-web mounts it from these bytes (a model given as bytes
    // has no folder to find it in)
    const given = Boolean(sessionOptions.externalData);
    const data = given ? null : await read(EXTERNAL_DATA);
    if (data) sessionOptions.externalData = [{ path: EXTERNAL_DATA, data }];
    let session;
    try {
      session = await ort.InferenceSession.create(model, sessionOptions);
    } catch (error) {
      throw new TrainingError(`onnxruntime cannot load ${MODEL_FILES.train}: ${firstLine(error)}`);
    }
    const trainer = new Trainer(ort, layout, new Runner(session, layout.train, "train"), options);
    trainer.read = read;
    trainer.sessionOptions = sessionOptions;
    trainer.externalDataGiven = given;
    trainer.loadStateDict(checkpoint);
    return trainer;
  }

  constructor(ort, layout, runner, { lr, nonfinite = "raise" } = {}) {
    if (!["raise", "skip"].includes(nonfinite)) throw new TrainingError(`nonfinite must be "raise" or "skip", not ${JSON.stringify(nonfinite)}`);
    this.ort = ort;
    this.layout = layout;
    this.runner = runner;
    this.runners = { train: runner }; // the other models' sessions, created when first used
    this.lr = lr ?? layout.optimizer.lr;
    this.nonfinite = nonfinite;
    this.stepCount = 0;
    this.skippedSteps = 0;
    this.state = new Map(); // key -> ort.Tensor: parameters, optimiser state, buffers
    this.accumulated = new Map(); // key -> ort.Tensor: the gradients summed over the pending micro-batches
    this.microBatches = 0;
    this.poisoned = false; // nonfinite "skip": a pending micro-batch was not finite
  }

  get batchNames() {
    return [...this.layout.train.batch];
  }

  /** The learning rate of the next optimiser step: lr times the schedule's factor after stepCount steps. */
  get learningRate() {
    return this.lr * scheduleFactor(this.layout.lr_schedule, this.stepCount);
  }

  /** One optimiser step on `batch` ({name: tensor}); resolves to the loss (before the update). */
  async step(batch, { lr = this.learningRate } = {}) {
    if (this.microBatches) throw new TrainingError("accumulated gradients are pending: call apply() before step()");
    const number = this.stepCount + 1; // the step being taken counts from 1 (Adam's bias correction)
    const { loss, kept, feeds } = await this.#run(this.runner, batch, { lr, step: number, micro_batch: 0 });
    if (kept) {
      this.stepCount += 1;
    } else if (this.nonfinite === "skip") {
      this.skippedSteps += 1;
    } else {
      throw this.#notFinite(`step ${number}`, loss, this.runner, feeds);
    }
    return loss;
  }

  /** Adds the gradients of `batch` to the accumulators; resolves to its loss. */
  async accumulate(batch) {
    const runner = await this.#model("accumulate");
    if (this.microBatches === 0) {
      // the accumulators come first in carry, one per parameter read
      this.accumulated.clear();
      runner.layout.reads.forEach(([param], i) => {
        const { type, dims, data } = this.state.get(param);
        this.accumulated.set(runner.layout.carry[i][0], new this.ort.Tensor(type, new data.constructor(data.length), dims));
      });
    }
    const given = { step: this.stepCount + 1, micro_batch: this.microBatches }; // (the hashed Dropout's seeds)
    const { loss, kept, feeds } = await this.#run(runner, batch, given);
    if (!kept && this.nonfinite === "raise") {
      throw this.#notFinite(`micro-batch ${this.microBatches + 1} of step ${this.stepCount + 1}`, loss, runner, feeds);
    }
    this.poisoned ||= !kept;
    this.microBatches += 1;
    return loss;
  }

  /** One optimiser step with the mean of the accumulated gradients. */
  async apply({ lr = this.learningRate } = {}) {
    if (this.microBatches === 0) throw new TrainingError("apply() needs accumulate() first: no gradient has been accumulated");
    const runner = await this.#model("apply");
    const number = this.stepCount + 1;
    const given = { lr, step: number, grad_scale: 1 / this.microBatches };
    const kept = !this.poisoned && (await this.#run(runner, {}, given)).kept;
    if (!kept && this.nonfinite === "raise") throw this.#notFinite(`step ${number}`, undefined, runner, {});
    if (kept) this.stepCount += 1;
    else this.skippedSteps += 1;
    this.microBatches = 0;
    this.poisoned = false;
  }

  /** Runs `runner` on `batch` with the state it carries and reads and its scalar inputs, computed
   * from `given` ({lr, step, micro_batch, grad_scale}) as the layout says (float64, then the
   * input's type); keeps its new values when the loss and they are finite. Resolves to {loss
   * (undefined for the apply model), kept, feeds}. */
  async #run(runner, batch, given) {
    const { ort } = this;
    const { carry, reads, scalars, coefficients = {}, loss: lossName, kept: keptName } = runner.layout;
    const feeds = runner.feeds(ort, batch);
    for (const [key, input] of [...carry, ...reads]) feeds[input] = this.state.get(key) ?? this.accumulated.get(key);
    for (const [key, input] of Object.entries(scalars ?? {})) {
      const value = key in coefficients ? evaluateCoefficient(coefficients[key], given) : given[key];
      if (value === undefined) throw new TrainingError(`the ${runner.kind} model takes a scalar '${key}' that this trainer does not know`);
      const type = runner.meta[input]?.type ?? (key === "step" ? "int64" : "float32");
      feeds[input] = scalarTensor(ort, type, value, input);
    }
    const results = await runner.run(feeds);
    const loss = lossName ? Number(results[lossName].data[0]) : undefined;
    // artifacts with a "kept" output decide in the graph; older ones by the new parameters, buffers
    // and accumulators, which a non-finite gradient makes non-finite (already on the host)
    const optimiserState = new Set(this.layout.train.carry.map(([key]) => key));
    for (const key of [...this.layout.params, ...this.layout.buffers]) optimiserState.delete(key);
    const kept = (loss === undefined || Number.isFinite(loss)) && (keptName ? Boolean(results[keptName].data[0])
      : carry.every(([key, , output]) => optimiserState.has(key) || allFinite(results[output])));
    if (kept) {
      for (const [key, , output] of carry) (this.accumulated.has(key) ? this.accumulated : this.state).set(key, results[output]);
    }
    return { loss, kept, feeds };
  }

  /** The error for a step or micro-batch that was not kept, naming what was not finite. */
  #notFinite(what, loss, runner, feeds) {
    const cause = loss === undefined ? "the update is not finite: a gradient (or the new value of a parameter) is NaN or Inf"
      : Number.isFinite(loss) ? `the loss is ${loss} but a gradient (or the new value of a parameter) is NaN or Inf`
        : `the loss is ${loss}`;
    const bad = Object.entries(feeds).filter(([name, t]) => runner.layout.batch.includes(name) && !allFinite(t));
    const inputs = bad.length ? `; batch input ${bad.map(([name]) => `'${name}'`).join(", ")} holds NaN or Inf` : "";
    return new TrainingError(`${what}: ${cause}${inputs}. Nothing was updated; nonfinite "skip" skips such steps instead`);
  }

  /** The runner of the eval, accumulate or apply model, its session created when first used. */
  async #model(kind) {
    if (!this.runners[kind]) {
      const file = MODEL_FILES[kind];
      const model = this.layout[kind] ? await this.read(file) : null;
      if (!model) {
        throw new TrainingError(`the artifacts have no ${file}` + (kind === "eval" ? "" : ": generate them with gradient_accumulation=True"));
      }
      let options = this.sessionOptions;
      // a directory saved with external_data=True has the model's own data file as well
      const own = this.externalDataGiven ? null : await this.read(`${file}.data`);
      if (own) options = { ...options, externalData: [...(options.externalData ?? []), { path: `${file}.data`, data: own }] };
      let session;
      try {
        session = await this.ort.InferenceSession.create(model, options);
      } catch (error) {
        throw new TrainingError(`onnxruntime cannot load ${file}: ${firstLine(error)}`);
      }
      this.runners[kind] = new Runner(session, this.layout[kind], kind);
    }
    return this.runners[kind];
  }

  /** The eval model on `batch` (inputs and labels): {loss, ...model outputs as tensors}. */
  async evaluate(batch) {
    const runner = await this.#model("eval");
    const feeds = runner.feeds(this.ort, batch);
    for (const [key, input] of runner.layout.reads) feeds[input] = this.state.get(key);
    const results = await runner.run(feeds);
    const out = { loss: Number(results[runner.layout.loss].data[0]) };
    for (const name of runner.layout.outputs) out[name] = results[name];
    return out;
  }

  /** The trained parameters: {name: ort.Tensor}. */
  parameters() {
    return Object.fromEntries(this.layout.params.map((name) => [name, this.state.get(name)]));
  }

  /** Parameters, optimiser state and buffers with __step__, as a checkpoint holds them. */
  stateDict() {
    const state = Object.fromEntries(this.state);
    state[STEP_KEY] = { type: "int64", dims: [], data: BigInt64Array.of(BigInt(this.stepCount)) };
    return state;
  }

  /** Loads {name: tensor}; checks every value against the train model before changing any. */
  loadStateDict(checkpoint) {
    const { carry, reads } = this.layout.train;
    const inputs = new Map([...carry, ...reads].map(([key, input]) => [key, input]));
    const missing = [...inputs.keys()].filter((key) => !(key in checkpoint));
    if (missing.length) throw new TrainingError(`the checkpoint lacks ${JSON.stringify(missing)}`);
    const loaded = new Map();
    for (const [key, tensor] of Object.entries(checkpoint)) {
      if (key === STEP_KEY) continue;
      const meta = this.runner.meta[inputs.get(key)];
      const dims = Array.from(tensor.dims);
      if (meta?.isTensor && (meta.type !== tensor.type || (meta.shape.length && (meta.shape.length !== dims.length
          || meta.shape.some((d, i) => typeof d === "number" && d >= 0 && d !== dims[i]))))) {
        throw new TrainingError(`checkpoint value '${key}' is ${tensor.type} ${shapeText(dims)}; the train model takes ${meta.type} ${shapeText(meta.shape)}`);
      }
      if (!allFinite(tensor)) {
        throw new TrainingError(`checkpoint value '${key}' holds NaN or Inf: refusing to load it (a diverged run or a damaged file); load an earlier checkpoint`);
      }
      loaded.set(key, tensor instanceof this.ort.Tensor ? tensor : new this.ort.Tensor(tensor.type, tensor.data, dims));
    }
    const step = checkpoint[STEP_KEY];
    this.state = loaded;
    this.stepCount = step ? Number(step.data[0]) : 0;
    this.accumulated.clear(); // a pending step's gradients are dropped, as the Python Trainer drops them
    this.microBatches = 0;
    this.poisoned = false;
  }

  /** The state as the bytes of a safetensors checkpoint. */
  checkpointBytes() {
    return serialize(this.stateDict());
  }
}
