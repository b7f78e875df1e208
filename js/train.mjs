#!/usr/bin/env node
// Trains onnx-autodiff training artifacts on onnxruntime-node and writes a safetensors checkpoint.
import { randomBytes } from "node:crypto";
import fs from "node:fs/promises";
import path from "node:path";
import { parseArgs } from "node:util";

import { parse } from "./safetensors.mjs";
import { rowCount, sliceRows, Trainer, TrainingError } from "./trainer.mjs";

const USAGE = `usage: node js/train.mjs ARTIFACTS_DIR --data DATA.safetensors --out OUT.safetensors
                     (--steps N | --epochs E [--batch-size B]) [--checkpoint FILE.safetensors]
                     [--lr LR] [--nonfinite raise|skip] [--backend cpu|webgpu|auto] [--quiet]

Trains the artifacts in ARTIFACTS_DIR (training_model.onnx, artifacts.json, checkpoint.safetensors)
on DATA, whose arrays are named after the train model's batch inputs, and writes the trained
parameters, optimiser state and __step__ to OUT. --steps N takes N steps on the whole of DATA;
--epochs E passes over it E times in batches of B rows, in order (the last one may be smaller;
default B: all rows). --checkpoint resumes from a checkpoint instead of the artifacts' own. Prints
the loss of each step (--steps) or each epoch's mean loss, weighted by batch sizes (--epochs).
--backend picks onnxruntime-node's execution provider: cpu (the default), webgpu (its Dawn build;
an error when there is no adapter) or auto (webgpu when it has an adapter, else cpu, said on
stderr). Artifacts built with --target webgpu run every compute node on the WebGPU provider.`;

class UsageError extends Error {}
class BackendError extends Error {}

const BACKENDS = ["cpu", "webgpu", "auto"];

/** Why onnxruntime-node cannot run "webgpu" here (one line), or undefined when it can: its build
 * may lack the provider, and Dawn, which it is built on, needs a Vulkan driver to offer an adapter
 * (it fails at session creation, not at import). */
function webgpuMissing(ort, error) {
  const bundled = ort.listSupportedBackends?.().some((b) => b.name === "webgpu" && b.bundled);
  if (ort.listSupportedBackends && !bundled) return "this onnxruntime-node build has no WebGPU execution provider";
  const text = String(error?.message ?? "");
  const adapter = /Failed to get a WebGPU adapter: ?([^\n]*)/.exec(text);
  if (adapter) {
    return `onnxruntime-node's WebGPU provider found no adapter (${adapter[1].trim() || "none"}): it needs a Vulkan `
      + "driver (libvulkan.so.1 and an ICD; SwiftShader's on a machine without a GPU)";
  }
  return undefined;
}

function options(argv) {
  let parsed;
  try {
    parsed = parseArgs({
      args: argv,
      allowPositionals: true,
      options: {
        data: { type: "string" }, out: { type: "string" }, steps: { type: "string" }, epochs: { type: "string" },
        "batch-size": { type: "string" }, checkpoint: { type: "string" }, lr: { type: "string" },
        nonfinite: { type: "string", default: "raise" }, backend: { type: "string", default: "cpu" }, quiet: { type: "boolean", default: false },
        help: { type: "boolean", short: "h", default: false },
      },
    });
  } catch (error) {
    throw new UsageError(`${error.message.split(". ")[0]} (see --help)`);
  }
  const { values, positionals } = parsed;
  if (values.help) return { help: true };
  if (positionals.length !== 1) throw new UsageError(`give one ARTIFACTS_DIR, not ${positionals.length} (${JSON.stringify(positionals)})`);
  for (const name of ["data", "out"]) if (!values[name]) throw new UsageError(`--${name} is required`);
  if ((values.steps === undefined) === (values.epochs === undefined)) throw new UsageError("give either --steps N or --epochs E");
  if (values["batch-size"] !== undefined && values.epochs === undefined) throw new UsageError("--batch-size goes with --epochs");
  if (!["raise", "skip"].includes(values.nonfinite)) throw new UsageError(`--nonfinite must be raise or skip, not ${values.nonfinite}`);
  if (!BACKENDS.includes(values.backend)) throw new UsageError(`--backend must be ${BACKENDS.join(", ")}, not ${values.backend}`);
  const count = (name) => {
    const text = values[name];
    if (text === undefined) return undefined;
    if (!/^[0-9]+$/.test(text) || Number(text) < 1) throw new UsageError(`--${name} must be a whole number >= 1, not ${text}`);
    return Number(text);
  };
  let lr;
  if (values.lr !== undefined) {
    lr = Number(values.lr);
    if (values.lr.trim() === "" || !Number.isFinite(lr) || lr < 0) throw new UsageError(`--lr must be a number >= 0, not ${values.lr}`);
  }
  return {
    artifacts: positionals[0], data: values.data, out: values.out, steps: count("steps"), epochs: count("epochs"),
    batchSize: count("batch-size"), checkpoint: values.checkpoint, lr, nonfinite: values.nonfinite, quiet: values.quiet,
    backend: values.backend,
  };
}

async function readSafetensors(file, what) {
  let bytes;
  try {
    bytes = await fs.readFile(file);
  } catch (error) {
    throw new UsageError(`cannot read ${what} ${file}: ${error.code === "ENOENT" ? "no such file" : error.message}`);
  }
  try {
    return parse(bytes).tensors;
  } catch (error) {
    throw new UsageError(`${file}: ${error.message}`);
  }
}

/** Writes `bytes` to `file` through a temporary file beside it and a rename: never half-written. */
async function writeAtomically(file, bytes) {
  const temporary = path.join(path.dirname(path.resolve(file)), `.onnx-autodiff-${randomBytes(6).toString("hex")}.tmp`);
  try {
    await fs.writeFile(temporary, bytes, { flag: "wx" });
    const mode = await fs.stat(file).then((s) => s.mode & 0o7777, () => undefined); // a replaced file keeps its mode
    if (mode !== undefined) await fs.chmod(temporary, mode);
    await fs.rename(temporary, file);
  } catch (error) {
    await fs.rm(temporary, { force: true });
    throw new TrainingError(`cannot write ${file}: ${error.message}`);
  }
}

async function main(argv) {
  const args = options(argv);
  if (args.help) {
    console.log(USAGE);
    return;
  }
  const stat = await fs.stat(args.artifacts).catch(() => undefined);
  if (!stat?.isDirectory()) throw new UsageError(`${args.artifacts} is not a directory of training artifacts`);
  const layout = await fs.stat(path.join(args.artifacts, "artifacts.json")).catch(() => undefined);
  if (!layout) throw new UsageError(`${args.artifacts} holds no training artifacts (no artifacts.json)`);
  const outStat = await fs.stat(args.out).catch(() => undefined);
  const outDir = await fs.stat(path.dirname(path.resolve(args.out))).catch(() => undefined);
  if (outStat?.isDirectory() || !outDir?.isDirectory()) {
    throw new UsageError(`--out ${args.out}: ${outStat ? "is a directory" : "no such directory"}; give a file to write`);
  }
  const data = await readSafetensors(args.data, "the data file");
  const checkpoint = args.checkpoint ? await readSafetensors(args.checkpoint, "the checkpoint") : undefined;
  const ort = await import("onnxruntime-node").catch((error) => {
    throw new UsageError(`cannot load onnxruntime-node (run npm ci --ignore-scripts --prefix js): ${error.message.split("\n")[0]}`);
  });
  const read = (name) => fs.readFile(path.join(args.artifacts, name)).catch((error) => {
    if (error.code === "ENOENT") return null;
    throw error;
  });
  const open = (backend) => Trainer.open(ort, read, { lr: args.lr, nonfinite: args.nonfinite, checkpoint,
    sessionOptions: { executionProviders: [backend] } });
  let trainer;
  let backend = args.backend === "auto" ? "webgpu" : args.backend;
  try {
    trainer = await open(backend);
  } catch (error) {
    const missing = backend === "webgpu" ? webgpuMissing(ort, error) : undefined;
    if (!missing) throw error;
    if (args.backend !== "auto") throw new BackendError(`--backend webgpu: ${missing}`);
    process.stderr.write(`train.mjs: --backend auto: training on cpu: ${missing}\n`);
    trainer = await open((backend = "cpu"));
  }
  const say = args.quiet ? () => {} : (line) => console.log(line);
  const start = performance.now();
  let steps = 0;
  if (args.steps) {
    for (; steps < args.steps; steps++) {
      const skipped = trainer.skippedSteps;
      const loss = await trainer.step(data);
      say(`step ${steps + 1}  loss ${loss.toFixed(6)}${trainer.skippedSteps > skipped ? "  skipped: not finite" : ""}`);
    }
  } else {
    const rows = rowCount(data);
    const size = args.batchSize ?? rows;
    for (let epoch = 1; epoch <= args.epochs; epoch++) {
      let total = 0;
      let batches = 0;
      for (let first = 0; first < rows; first += size, batches++, steps++) {
        const last = Math.min(rows, first + size);
        total += (await trainer.step(sliceRows(data, first, last))) * (last - first);
      }
      say(`epoch ${epoch}  loss ${(total / rows).toFixed(6)}  (${batches} steps)`); // weighted by batch sizes
    }
  }
  await writeAtomically(args.out, trainer.checkpointBytes());
  const seconds = (performance.now() - start) / 1000;
  say(`trained ${steps} steps (${trainer.skippedSteps} skipped) in ${seconds.toFixed(2)} s on ${backend}; wrote ${args.out}`);
}

main(process.argv.slice(2)).catch((error) => {
  const known = error instanceof UsageError || error instanceof TrainingError || error instanceof BackendError;
  process.stderr.write(`train.mjs: error: ${known ? error.message : String(error?.message ?? error).split("\n")[0]}\n`);
  // 3: the backend asked for is not available here (a caller may retry on cpu), apart from bad usage
  process.exitCode = error instanceof UsageError ? 2 : error instanceof BackendError ? 3 : 1;
});
