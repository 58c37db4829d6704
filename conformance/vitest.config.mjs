import { defineConfig } from "vitest/config"

export default defineConfig({
  test: {
    include: ["*.test.mjs"],
    // The suite sets its own timeouts where it needs longer ones; this is the default for the rest.
    testTimeout: 15000,
    hookTimeout: 15000,
  },
})
