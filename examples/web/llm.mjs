// Fine-tunes the LoRA adapters of the Llama-shaped decoder of build/llm-SIZE (python
// examples/web/prepare_llm.py) to reproduce one sentence, with js/trainer.mjs on onnxruntime-web:
// WebGPU when the browser offers an adapter, else WebAssembly (?backend=wasm|webgpu forces one).
// It draws the loss of each step, and shows the tokens per second, the WebAssembly memory in use
// and a greedy generation before and after training, read from the eval model's logits (the base
// and the adapters as trained, not merged). When done, body[data-state] is "done" and
// window.trainingResult holds the figures (check.py --llm reads them); on a failure it is "error".
import { Trainer } from "../../js/trainer.mjs";

const query = new URLSearchParams(location.search);
const SIZE = query.get("size") === "full" ? "full" : "small";
const STEPS = Number(query.get("steps") ?? (SIZE === "full" ? 30 : 100));

// onnxruntime-web creates its WebAssembly.Memory itself (the threaded build) or gets it from the
// instance's exports (one thread) and does not expose it: keep a reference to each, before it
// loads, to read the size of the linear memory (which never shrinks: its high-water mark)
const memories = [];
const NativeMemory = WebAssembly.Memory;
WebAssembly.Memory = function Memory(descriptor) {
  const memory = new NativeMemory(descriptor);
  memories.push(memory);
  return memory;
};
WebAssembly.Memory.prototype = NativeMemory.prototype;
for (const name of ["instantiate", "instantiateStreaming"]) {
  const native = WebAssembly[name];
  WebAssembly[name] = async (...args) => {
    const result = await native.apply(WebAssembly, args);
    for (const value of Object.values((result.instance ?? result).exports ?? {})) {
      if (value instanceof NativeMemory && !memories.includes(value)) memories.push(value);
    }
    return result;
  };
}
const wasmBytes = () => Math.max(0, ...memories.map((m) => m.buffer.byteLength));

const adapter = await navigator.gpu?.requestAdapter().catch(() => null);
const BACKEND = ["wasm", "webgpu"].includes(query.get("backend")) ? query.get("backend") : adapter ? "webgpu" : "wasm";
// the WebGPU bundle holds both providers (its WebAssembly build with fewer kernel types)
const ort = await import("../../js/node_modules/onnxruntime-web/dist/ort.webgpu.min.mjs");
const FOLDER = `build/llm-${SIZE}`;
const ARTIFACTS = BACKEND === "webgpu" ? "artifacts-webgpu" : "artifacts";

const $ = (id) => document.getElementById(id);
const canvas = $("chart");

async function read(name) {
  const response = await fetch(`${FOLDER}/${name}`);
  return response.ok ? new Uint8Array(await response.arrayBuffer()) : null;
}

/** Token ids (bytes) as text, each control byte as its Unicode control picture (byte 2, the
 * start token, as ␂): an untrained model's output is mostly such bytes. */
function shown(ids) {
  const text = new TextDecoder("utf-8", { fatal: false }).decode(Uint8Array.from(ids));
  return text.replace(/[\x00-\x1f]/g, (c) => String.fromCharCode(0x2400 + c.charCodeAt(0))) || "(nothing: the end token first)";
}

/** The loss per step as a line on the canvas, the y axis from 0 to the first loss. */
function draw(losses, steps) {
  const context = canvas.getContext("2d");
  const box = { x: 50, y: 24, width: 760, height: 140 };
  const top = Math.max(1, Math.ceil(losses[0] ?? 1));
  context.clearRect(0, 0, canvas.width, canvas.height);
  context.font = "13px system-ui, sans-serif";
  context.fillStyle = "#333";
  context.strokeStyle = "#bbb";
  context.fillText("training loss (next-token cross-entropy, nats) per step", box.x, box.y - 8);
  context.strokeRect(box.x, box.y, box.width, box.height);
  context.textAlign = "right";
  for (const tick of [0, top / 2, top]) {
    const y = box.y + box.height * (1 - tick / top);
    context.fillText(tick.toFixed(1), box.x - 6, y + 4);
    context.beginPath();
    context.moveTo(box.x, y);
    context.lineTo(box.x + box.width, y);
    context.stroke();
  }
  context.textAlign = "center";
  context.fillText("1", box.x, box.y + box.height + 16);
  context.fillText(String(steps), box.x + box.width, box.y + box.height + 16);
  context.fillText("step", box.x + box.width / 2, box.y + box.height + 16);
  context.textAlign = "left";
  context.strokeStyle = "#1f6feb";
  context.lineWidth = 2;
  context.beginPath();
  losses.forEach((loss, i) => {
    const x = box.x + box.width * (steps > 1 ? i / (steps - 1) : 0.5);
    const y = box.y + box.height * (1 - Math.min(loss, top) / top);
    if (i === 0) context.moveTo(x, y);
    else context.lineTo(x, y);
  });
  context.stroke();
  context.lineWidth = 1;
}

/** Greedy generation from the start token: one full forward of the padded sequence per token,
 * the next token the argmax of the logits at the last filled position, until the end token. */
async function generate(trainer, info) {
  const { seq, vocab, bos, eos } = info;
  const ids = new BigInt64Array(seq).fill(BigInt(eos));
  ids[0] = BigInt(bos);
  const out = [];
  for (let position = 1; position < seq; position++) {
    const batch = { ids: { type: "int64", dims: [1, seq], data: ids }, labels: { type: "int64", dims: [1, seq], data: ids } };
    const { logits } = await trainer.evaluate(batch);
    const row = logits.data.subarray((position - 1) * vocab, position * vocab);
    let best = 0;
    for (let t = 1; t < vocab; t++) if (row[t] > row[best]) best = t;
    if (best === eos) break;
    ids[position] = BigInt(best);
    out.push(best);
  }
  return out;
}

const megabytes = (bytes) => `${(bytes / 2 ** 20).toFixed(0)} MB`;

async function main() {
  ort.env.wasm.numThreads = self.crossOriginIsolated ? Math.min(4, navigator.hardwareConcurrency) : 1;
  const bytes = await read("llm.json");
  if (!bytes) throw new Error(`no ${FOLDER}/llm.json: run python examples/web/prepare_llm.py --size ${SIZE}`);
  const info = JSON.parse(new TextDecoder().decode(bytes));
  $("model").textContent = `LlamaForCausalLM (random weights), ${(info.parameters / 1e6).toFixed(1)} M parameters: hidden `
    + `${info.hidden}, ${info.layers} layers, ${info.heads} heads (${info.kv_heads} KV), bytes as tokens (${info.vocab}); base in `
    + `${info.quantize}, LoRA rank ${info.rank} on every projection and the head; AdamW, lr ${info.lr}; ${BACKEND === "webgpu"
      ? "onnxruntime-web WebGPU" : `onnxruntime-web WebAssembly, ${ort.env.wasm.numThreads} thread(s)`}`;
  $("sentence").textContent = info.sentence;
  status("creating the sessions…");
  const opened = performance.now();
  const trainer = await Trainer.open(ort, (name) => read(`${ARTIFACTS}/${name}`),
    { sessionOptions: { executionProviders: [BACKEND] } });
  const sessionSeconds = (performance.now() - opened) / 1000;
  status("generating before training…");
  const before = await generate(trainer, info);
  $("before").textContent = shown(before);
  const ids = BigInt64Array.from(info.ids, BigInt);
  const batch = { ids: { type: "int64", dims: [1, info.seq], data: ids }, labels: { type: "int64", dims: [1, info.seq], data: ids } };
  const losses = [];
  const times = [];
  for (let step = 1; step <= STEPS; step++) {
    const start = performance.now();
    losses.push(await trainer.step(batch));
    times.push((performance.now() - start) / 1000);
    draw(losses, STEPS);
    const rate = info.seq / times.at(-1);
    status(`step ${step}/${STEPS}: loss ${losses.at(-1).toFixed(4)}, ${rate.toFixed(0)} tokens/s, `
      + `WebAssembly memory ${megabytes(wasmBytes())}`);
    await new Promise((resolve) => setTimeout(resolve)); // let the page paint
  }
  status("generating after training…");
  const after = await generate(trainer, info);
  $("after").textContent = shown(after);
  // the first step includes onnxruntime's warm-up (WebGPU compiles its shaders then): left out
  const steady = times.length > 1 ? times.slice(1) : times;
  const perStep = steady.reduce((a, b) => a + b, 0) / steady.length;
  const result = {
    backend: BACKEND, adapter: Boolean(adapter), size: SIZE, parameters: info.parameters, quantize: info.quantize,
    steps: trainer.stepCount, seq: info.seq, losses, firstLoss: losses[0], lastLoss: losses.at(-1),
    firstStepSeconds: times[0], secondsPerStep: perStep, tokensPerSecond: info.seq / perStep, sessionSeconds,
    wasmMemoryBytes: wasmBytes(), jsHeapBytes: performance.memory?.usedJSHeapSize ?? null,
    threads: ort.env.wasm.numThreads, isolated: self.crossOriginIsolated, sentence: info.sentence,
    before: new TextDecoder().decode(Uint8Array.from(before)), after: new TextDecoder().decode(Uint8Array.from(after)),
  };
  $("figures").textContent = `${result.steps} steps of ${info.seq} tokens: ${perStep.toFixed(3)} s per step after the first `
    + `(${times[0].toFixed(2)} s), ${result.tokensPerSecond.toFixed(0)} tokens/s; sessions ${sessionSeconds.toFixed(1)} s; `
    + `WebAssembly memory ${megabytes(result.wasmMemoryBytes)} (the linear memory's size)`
    + (result.jsHeapBytes ? `, JavaScript heap ${megabytes(result.jsHeapBytes)}` : "");
  status(`trained: loss ${losses[0].toFixed(3)} → ${losses.at(-1).toFixed(4)} on ${BACKEND}`);
  window.trainingResult = result;
  document.body.dataset.state = "done";
}

function status(text) {
  $("status").textContent = text;
}

main().catch((error) => {
  status(`error: ${error.message}`);
  window.trainingError = String(error.message ?? error);
  document.body.dataset.state = "error";
});
