// Checks artifacts.json files against artifacts.schema.json, the JSON Schema that
// onnx_autodiff/training/manifest.py generates from the classes the Python side reads them with:
//
//   node js/validate.mjs ARTIFACTS [ARTIFACTS ...]    (an artifacts directory or its artifacts.json)
//
// prints each file that does not match, with its first errors, and exits 1 if one does not (0 when
// all do). It needs ajv, a development dependency (npm ci installs it): the trainer itself reads
// artifacts.json as the schema describes it, without ajv, in Node and in the browser.

import fs from "node:fs/promises";
import path from "node:path";
import Ajv2020 from "ajv/dist/2020.js";

const schema = JSON.parse(await fs.readFile(new URL("./artifacts.schema.json", import.meta.url), "utf8"));
// allowUnionTypes: the schema writes a nullable value as {"type": [T, "null"]}
export const validate = new Ajv2020({ allErrors: true, allowUnionTypes: true }).compile(schema);

async function main(args) {
  if (!args.length) {
    process.stderr.write("usage: node js/validate.mjs ARTIFACTS [ARTIFACTS ...] (directories or artifacts.json files)\n");
    return 2;
  }
  let failed = 0;
  for (const arg of args) {
    const file = (await fs.stat(arg)).isDirectory() ? path.join(arg, "artifacts.json") : arg;
    if (validate(JSON.parse(await fs.readFile(file, "utf8")))) continue;
    failed += 1;
    const errors = validate.errors.slice(0, 5).map((e) => `  ${e.instancePath || "/"} ${e.message}`);
    process.stdout.write(`${file}: does not match artifacts.schema.json\n${errors.join("\n")}\n`);
  }
  process.stdout.write(`${args.length - failed} of ${args.length} match artifacts.schema.json\n`);
  return failed ? 1 : 0;
}

if (import.meta.url === `file://${process.argv[1]}`) process.exitCode = await main(process.argv.slice(2));
