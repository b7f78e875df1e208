// safetensors: an 8-byte little-endian header length, a JSON header
// {name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__"?: {string: string}}, then the raw
// little-endian data (offsets count from the end of the header). Tensors are {type, dims, data}
// with onnxruntime-js's type names and typed arrays, so `new ort.Tensor(type, data, dims)` takes them.
// Typed arrays use the platform's byte order: little-endian on every platform JavaScript runs on.

const TYPES = {
  F64: ["float64", Float64Array], F32: ["float32", Float32Array], F16: ["float16", Uint16Array],
  I64: ["int64", BigInt64Array], I32: ["int32", Int32Array], I16: ["int16", Int16Array], I8: ["int8", Int8Array],
  U64: ["uint64", BigUint64Array], U32: ["uint32", Uint32Array], U16: ["uint16", Uint16Array],
  U8: ["uint8", Uint8Array], BOOL: ["bool", Uint8Array],
};
const DTYPES = Object.fromEntries(Object.entries(TYPES).map(([dtype, [type]]) => [type, dtype]));
const MAX_HEADER = 100 * 1024 * 1024; // the format's own limit

export class SafetensorsError extends Error {}

const count = (dims) => dims.reduce((n, d) => n * d, 1);

/** The tensors and metadata of a safetensors file's bytes: {tensors: {name: {type, dims, data}}, metadata}. */
export function parse(bytes) {
  bytes = bytes instanceof Uint8Array ? bytes : new Uint8Array(bytes);
  if (bytes.byteLength < 8) throw new SafetensorsError(`not a safetensors file: ${bytes.byteLength} bytes`);
  const view = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
  const length = Number(view.getBigUint64(0, true));
  if (length > MAX_HEADER || 8 + length > bytes.byteLength) {
    throw new SafetensorsError(`not a safetensors file: a header of ${length} bytes in a file of ${bytes.byteLength}`);
  }
  let header;
  try {
    header = JSON.parse(new TextDecoder("utf-8", { fatal: true }).decode(bytes.subarray(8, 8 + length)));
  } catch (error) {
    throw new SafetensorsError(`not a safetensors file: its header is not JSON (${error.message})`);
  }
  if (header === null || typeof header !== "object" || Array.isArray(header)) {
    throw new SafetensorsError("not a safetensors file: its header is not a JSON object");
  }
  const start = 8 + length;
  const size = bytes.byteLength - start;
  const tensors = {};
  let metadata = {};
  for (const [name, entry] of Object.entries(header)) {
    if (name === "__metadata__") {
      metadata = entry ?? {};
      continue;
    }
    const [type, View] = TYPES[entry?.dtype] ?? [];
    if (!type) throw new SafetensorsError(`tensor '${name}' has the unsupported dtype ${JSON.stringify(entry?.dtype)}`);
    const dims = entry.shape;
    const [begin, end] = entry.data_offsets ?? [];
    if (!Array.isArray(dims) || !dims.every((d) => Number.isSafeInteger(d) && d >= 0)) {
      throw new SafetensorsError(`tensor '${name}' has an invalid shape ${JSON.stringify(dims)}`);
    }
    if (!Number.isSafeInteger(begin) || !Number.isSafeInteger(end) || begin < 0 || end > size
        || end - begin !== count(dims) * View.BYTES_PER_ELEMENT) {
      throw new SafetensorsError(`tensor '${name}' (${entry.dtype} ${JSON.stringify(dims)}) has data offsets `
        + `${JSON.stringify(entry.data_offsets)} that do not fit its ${count(dims)} elements in ${size} bytes of data`);
    }
    const offset = bytes.byteOffset + start + begin;
    const data = offset % View.BYTES_PER_ELEMENT === 0 // a view where aligned, else a copy
      ? new View(bytes.buffer, offset, count(dims))
      : new View(bytes.slice(start + begin, start + end).buffer);
    tensors[name] = { type, dims, data };
  }
  return { tensors, metadata };
}

/** The safetensors bytes of {name: {type, dims, data}} (onnxruntime-js tensors work too) with
 * optional string metadata. Widest types first, then by name: every tensor is aligned, the output
 * deterministic. */
export function serialize(tensors, metadata = undefined) {
  const entries = Object.entries(tensors).map(([name, tensor]) => {
    const dtype = DTYPES[tensor.type];
    if (!dtype) throw new SafetensorsError(`tensor '${name}' has the type ${tensor.type}, which safetensors cannot store`);
    const dims = Array.from(tensor.dims);
    const data = tensor.data;
    if (data.length !== count(dims)) {
      throw new SafetensorsError(`tensor '${name}' has ${data.length} elements for the shape ${JSON.stringify(dims)}`);
    }
    return { name, dtype, dims, bytes: new Uint8Array(data.buffer, data.byteOffset, data.byteLength) };
  });
  const width = (e) => TYPES[e.dtype][1].BYTES_PER_ELEMENT;
  entries.sort((a, b) => width(b) - width(a) || (a.name < b.name ? -1 : a.name > b.name ? 1 : 0));
  const header = {};
  if (metadata && Object.keys(metadata).length) header.__metadata__ = metadata;
  let offset = 0;
  for (const e of entries) {
    header[e.name] = { dtype: e.dtype, shape: e.dims, data_offsets: [offset, offset + e.bytes.byteLength] };
    offset += e.bytes.byteLength;
  }
  const json = new TextEncoder().encode(JSON.stringify(header));
  const padded = Math.ceil(json.byteLength / 8) * 8; // the data starts aligned; spaces pad, as the reference writer does
  const out = new Uint8Array(8 + padded + offset);
  new DataView(out.buffer).setBigUint64(0, BigInt(padded), true);
  out.fill(0x20, 8, 8 + padded);
  out.set(json, 8);
  let at = 8 + padded;
  for (const e of entries) {
    out.set(e.bytes, at);
    at += e.bytes.byteLength;
  }
  return out;
}
