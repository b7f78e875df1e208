// Trains the digits classifier of build/ (python examples/web/prepare.py) in the browser with the
// trainer module that Node's CLI uses, drawing the loss of each step and the test accuracy of each
// epoch. When done, body[data-state] is "done" and window.trainingResult holds the figures (the
// check script reads them); on a failure it is "error". ?backend=webgpu trains on onnxruntime-web's
// WebGPU provider the artifacts lowered for it (build/artifacts-webgpu), else on WebAssembly.
import { parse } from "../../js/safetensors.mjs";
import { rowCount, sliceRows, Trainer } from "../../js/trainer.mjs";

const EPOCHS = 15;
const BACKEND = new URLSearchParams(location.search).get("backend") === "webgpu" ? "webgpu" : "wasm";
// the WebGPU bundle holds both providers, its WebAssembly build with fewer kernel types
const ort = await import(BACKEND === "webgpu" ? "../../js/node_modules/onnxruntime-web/dist/ort.webgpu.min.mjs"
  : "onnxruntime-web");
const ARTIFACTS = BACKEND === "webgpu" ? "artifacts-webgpu" : "artifacts";
const BATCH = 32;

const status = document.getElementById("status");
const canvas = document.getElementById("chart");

async function read(name) {
  const response = await fetch(`build/${name}`);
  return response.ok ? new Uint8Array(await response.arrayBuffer()) : null;
}

/** A line chart of `values` in `box` ({x, y, width, height}) with y from 0 to `top`. */
function plot(context, box, title, values, { top, ticks, label, xLabel, count }) {
  const { x, y, width, height } = box;
  context.strokeStyle = "#bbb";
  context.fillStyle = "#333";
  context.font = "13px system-ui, sans-serif";
  context.fillText(title, x, y - 10);
  context.strokeRect(x, y, width, height);
  context.textAlign = "right";
  for (const tick of ticks) {
    const ty = y + height * (1 - tick / top);
    context.fillText(label(tick), x - 6, ty + 4);
    context.beginPath();
    context.moveTo(x, ty);
    context.lineTo(x + width, ty);
    context.stroke();
  }
  context.textAlign = "center";
  context.fillText(xLabel, x + width / 2, y + height + 18);
  context.fillText("1", x, y + height + 18);
  context.fillText(String(count), x + width, y + height + 18);
  context.textAlign = "left";
  context.strokeStyle = "#1f6feb";
  context.lineWidth = 2;
  context.beginPath();
  values.forEach((value, i) => {
    const px = x + (width * (count > 1 ? i / (count - 1) : 0.5));
    const py = y + height * (1 - Math.min(value, top) / top);
    if (i === 0) context.moveTo(px, py);
    else context.lineTo(px, py);
  });
  context.stroke();
  context.lineWidth = 1;
}

function draw(losses, accuracies, totalSteps) {
  const context = canvas.getContext("2d");
  context.clearRect(0, 0, canvas.width, canvas.height);
  const top = Math.max(0.5, Math.ceil(Math.max(...losses, 0) * 2) / 2);
  plot(context, { x: 50, y: 30, width: 340, height: 290 }, "training loss (cross-entropy) per step", losses,
    { top, ticks: [0, top / 2, top], label: (v) => v.toFixed(2), xLabel: "step", count: totalSteps });
  plot(context, { x: 480, y: 30, width: 340, height: 290 }, "test accuracy per epoch", accuracies,
    { top: 1, ticks: [0, 0.5, 0.9, 1], label: (v) => `${Math.round(v * 100)}%`, xLabel: "epoch", count: EPOCHS });
}

/** The backend and the WebAssembly threads in use (onnxruntime-web falls back to one thread
 * without cross-origin isolation, whatever numThreads asked). */
function backendText() {
  if (BACKEND === "webgpu") return "backend webgpu";
  const isolation = self.crossOriginIsolated ? "cross-origin isolated" : "not cross-origin isolated: one thread";
  return `backend ${BACKEND}, ${ort.env.wasm.numThreads} thread(s), ${isolation}`;
}

function accuracy(logits, labels) {
  const classes = logits.dims[1];
  let right = 0;
  for (let row = 0; row < labels.length; row++) {
    const scores = logits.data.subarray(row * classes, (row + 1) * classes);
    right += scores.indexOf(Math.max(...scores)) === Number(labels[row]);
  }
  return right / labels.length;
}

async function main() {
  // threads need cross-origin isolation (COOP/COEP headers); without it one thread
  ort.env.wasm.numThreads = self.crossOriginIsolated ? Math.min(4, navigator.hardwareConcurrency) : 1;
  const [train, test] = await Promise.all(["train", "test"].map(async (name) => {
    const bytes = await read(`${name}.safetensors`);
    if (!bytes) throw new Error(`no build/${name}.safetensors: run python examples/web/prepare.py`);
    return parse(bytes);
  }));
  const trainer = await Trainer.open(ort, (name) => read(`${ARTIFACTS}/${name}`),
    { sessionOptions: { executionProviders: [BACKEND] } });
  const rows = rowCount(train.tensors);
  const perEpoch = Math.ceil(rows / BATCH);
  const losses = [];
  const accuracies = [];
  const start = performance.now();
  for (let epoch = 1; epoch <= EPOCHS; epoch++) {
    for (let first = 0; first < rows; first += BATCH) {
      losses.push(await trainer.step(sliceRows(train.tensors, first, Math.min(rows, first + BATCH))));
    }
    const result = await trainer.evaluate(test.tensors);
    accuracies.push(accuracy(result.logits, test.tensors.labels.data));
    draw(losses, accuracies, EPOCHS * perEpoch);
    status.textContent = `epoch ${epoch}/${EPOCHS}: training loss ${losses.at(-1).toFixed(4)}, `
      + `test accuracy ${(accuracies.at(-1) * 100).toFixed(1)}% (${backendText()})`;
    await new Promise((resolve) => setTimeout(resolve)); // let the page paint
  }
  const seconds = (performance.now() - start) / 1000;
  const final = accuracies.at(-1);
  const source = train.metadata.source ?? "";
  const tested = rowCount(test.tensors);
  status.textContent = `${source} digits, ${rows} train / ${tested} test: `
    + `${trainer.stepCount} steps in ${seconds.toFixed(1)} s, test accuracy ${(final * 100).toFixed(1)}% `
    + `(${backendText()})`;
  window.trainingResult = {
    accuracy: final, steps: trainer.stepCount, epochs: EPOCHS, seconds, source, train: rows, test: tested,
    threads: ort.env.wasm.numThreads, backend: BACKEND, isolated: self.crossOriginIsolated,
    cores: navigator.hardwareConcurrency,
  };
  document.body.dataset.state = "done";
}

main().catch((error) => {
  status.textContent = `error: ${error.message}`;
  window.trainingError = String(error.message ?? error);
  document.body.dataset.state = "error";
});
