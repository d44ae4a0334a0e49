// Loaded into every Node harness with `node --require` (NODE_OPTIONS): makes Node's built-in
// fetch honour HTTPS_PROXY / HTTP_PROXY / NO_PROXY on Node 18-22, where only the http module's
// agents do (NODE_USE_ENV_PROXY works from Node 24 on). Without it, a harness whose client is
// fetch (Continue with Gemini, Grok CLI) connects directly, fails, and records no turn.
//
// undici's EnvHttpProxyAgent becomes the global dispatcher, which Node's fetch reads from the
// same global symbol undici's own setGlobalDispatcher writes. The undici package comes from the
// path in POLAR_MITM_UNDICI (polar-mitm installs it beside the harness CLIs); where it is missing,
// or the harness already set a dispatcher of its own, nothing changes.
"use strict";
(function () {
  const where = process.env.POLAR_MITM_UNDICI;
  if (!where || !(process.env.HTTPS_PROXY || process.env.https_proxy)) return;
  if (globalThis[Symbol.for("undici.globalDispatcher.1")] !== undefined) return;
  try {
    const undici = require(where);
    if (typeof undici.EnvHttpProxyAgent !== "function") return;
    // undici warns that the agent is experimental; that line would land in every harness's output.
    const emit = process.emitWarning;
    process.emitWarning = function (warning, ...rest) {
      const code = typeof rest[0] === "object" && rest[0] ? rest[0].code : rest[1];
      if (code === "UNDICI-EHPA") return;
      return emit.call(this, warning, ...rest);
    };
    try {
      undici.setGlobalDispatcher(new undici.EnvHttpProxyAgent());
    } finally {
      process.emitWarning = emit;
    }
  } catch (e) {
    if (process.env.POLAR_MITM_DEBUG) process.stderr.write(`polar-mitm: fetch proxy not set: ${e}\n`);
  }
})();
