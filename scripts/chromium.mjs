// Debian's `chromium` for the headless-browser tests (dashboard-tests/, the incident-triage
// example's browser-tests/, conformance/browser/): installing it when missing, and launching it
// through playwright-core. Plain ESM with Node built-ins only: each test package imports it by
// relative path and passes in its own playwright-core `chromium` (a bare `playwright-core` import
// here would not resolve: it lives in the packages' node_modules/, not next to this file).
//
//   node scripts/chromium.mjs install [why]   # from the run scripts, before the tests
//
// `install` does nothing when CHROMIUM is set or `chromium` is on PATH; otherwise it runs, as root
// or through sudo, `apt-get update -qq` and `apt-get install -y -qq --no-install-recommends
// chromium` (DEBIAN_FRONTEND=noninteractive, stdin closed) and exits non-zero when either fails.
import { execFileSync } from "node:child_process"
import { accessSync, constants, realpathSync } from "node:fs"
import { delimiter, join } from "node:path"
import { fileURLToPath } from "node:url"

// The browser binary the tests launch: CHROMIUM, else Debian's.
export const CHROMIUM = process.env.CHROMIUM ?? "/usr/bin/chromium"

// Command-line flags for every launch.
export const CHROMIUM_ARGS = Object.freeze(["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
  "--disable-background-networking", "--disable-component-update", "--disable-sync"])

// A headless Chromium with its own profile directory (so its own storage: one "device"), through
// playwright-core's `chromium` (the caller's import). `options` adds to or overrides the launch
// options (viewport, colorScheme, …). Resolves to the BrowserContext.
export function launchChromium(chromium, profileDir, options = {}) {
  return chromium.launchPersistentContext(profileDir, {
    executablePath: CHROMIUM,
    headless: true,
    args: [...CHROMIUM_ARGS],
    ...options,
  })
}

// The first executable `name` on PATH (as `command -v` finds it), or null.
export function onPath(name) {
  for (const dir of (process.env.PATH ?? "").split(delimiter)) {
    if (!dir) continue
    try {
      accessSync(join(dir, name), constants.X_OK)
      return join(dir, name)
    } catch {}
  }
  return null
}

// Installs Debian's chromium with apt-get unless CHROMIUM is set or `chromium` is on PATH. `why`
// (e.g. "for the EventSource test") is appended to the log line. Throws when apt-get fails.
export function ensureChromium(why = "") {
  if (process.env.CHROMIUM || onPath("chromium")) return
  console.log(`\n==> installing chromium (Debian package)${why ? " " + why : ""}`)
  const root = process.getuid?.() === 0
  const run = (args, stdout) => {
    const [cmd, argv] = root ? ["apt-get", args] : ["sudo", ["apt-get", ...args]]
    execFileSync(cmd, argv, { stdio: ["ignore", stdout, "inherit"], env: { ...process.env, DEBIAN_FRONTEND: "noninteractive" } })
  }
  run(["update", "-qq"], "inherit")
  run(["install", "-y", "-qq", "--no-install-recommends", "chromium"], "ignore")
}

const main = (() => { try { return realpathSync(process.argv[1] ?? "") } catch { return null } })()
if (main === fileURLToPath(import.meta.url)) {
  const [cmd, ...why] = process.argv.slice(2)
  if (cmd !== "install") {
    console.error("usage: node scripts/chromium.mjs install [why]")
    process.exit(2)
  }
  try {
    ensureChromium(why.join(" "))
  } catch (e) {
    console.error(`chromium install failed: ${e.message}`)
    process.exit(typeof e.status === "number" && e.status ? e.status : 1)
  }
}
