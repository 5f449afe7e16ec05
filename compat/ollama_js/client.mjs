// Ollama's official JavaScript library (npm `ollama`) against a smolserve server: each call as an app makes it,
// its answers printed as one JSON object for compat/test_ollama_js.py to check. Usage: node client.mjs URL MODEL EMBED,
// with OLLAMA_JS_MODULES the node_modules folder the library is installed in.
import { createRequire } from "node:module";

const require = createRequire(`${process.env.OLLAMA_JS_MODULES}/`);
const { Ollama } = require("ollama");

const [host, model, embedModel] = process.argv.slice(2);
const ollama = new Ollama({ host });
const ask = [{ role: "user", content: "Name a color." }];
const out = {};

out.version = (await ollama.version()).version;
out.listed = (await ollama.list()).models.map((m) => m.model);
const shown = await ollama.show({ model });
out.show = { capabilities: shown.capabilities, family: shown.details.family, info: shown.model_info };
const whole = await ollama.chat({ model, messages: ask, options: { temperature: 0, num_predict: 8 } });
let streamed = "";
for await (const part of await ollama.chat({ model, messages: ask, stream: true,
                                             options: { temperature: 0, num_predict: 8 } })) {
  streamed += part.message.content;
}
out.chat = { whole: whole.message.content, streamed, eval_count: whole.eval_count, done_reason: whole.done_reason };
const first = await ollama.generate({ model, prompt: "Count: 1, 2,", raw: true, options: { num_predict: 4 } });
const again = await ollama.generate({ model, prompt: " and", raw: true, context: first.context,
                                      options: { num_predict: 2 } });
out.generate = { context: first.context.length, prompt_eval_count: again.prompt_eval_count };
const schema = { type: "object", properties: { color: { type: "string" } }, required: ["color"] };
const formatted = await ollama.chat({ model, messages: ask, format: schema, options: { temperature: 0 } });
out.format = JSON.parse(formatted.message.content);
const tools = [{ type: "function", function: { name: "get_weather", description: "The weather in a city",
  parameters: { type: "object", properties: { city: { type: "string" } }, required: ["city"] } } }];
const ask2 = [{ role: "user", content: "What is the weather in Paris? Use the tool." }];
const called = await ollama.chat({ model, messages: ask2, tools, options: { temperature: 0, num_predict: 64 } });
out.tools = { calls: called.message.tool_calls ?? [] };
if (out.tools.calls.length) {
  const answered = await ollama.chat({ model, tools, options: { temperature: 0, num_predict: 16 }, messages: [
    ...ask2, called.message, { role: "tool", tool_name: "get_weather", content: "sunny, 21 C" }] });
  out.tools.answered = answered.done;
}
const vectors = (await ollama.embed({ model: embedModel, input: ["a cat", "a dog"] })).embeddings;
out.embed = vectors.map((v) => v.reduce((sum, x) => sum + x * x, 0));
out.create = (await ollama.create({ model: "js-terse", from: model, system: "One word.",
                                    parameters: { num_predict: 3, temperature: 0 } })).status;
out.made = (await ollama.chat({ model: "js-terse", messages: ask })).eval_count;
await ollama.delete({ model: "js-terse" });
try {
  await ollama.chat({ model: "no-such-model", messages: ask });
  out.error = null;
} catch (error) {
  out.error = { status: error.status_code, message: error.error };
}
console.log(JSON.stringify(out));
