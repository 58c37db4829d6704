// The official TypeScript client (@durable-streams/client, pinned in package.json) against a
// running `baton serve`: create, append, read live (SSE and long-poll), resume from a saved
// offset, idempotent producer with close.
//
//   CONFORMANCE_BASE_URL=http://127.0.0.1:7700 npx vitest run clients.test.mjs
import { describe, expect, test } from "vitest"
import { DurableStream, IdempotentProducer } from "@durable-streams/client"

const baseUrl = process.env.CONFORMANCE_BASE_URL
if (!baseUrl) throw new Error("set CONFORMANCE_BASE_URL to the base URL of a running `baton serve`")
const unique = (name) => `${baseUrl}/v1/stream/ts-client/${name}-${Date.now()}-${Math.random().toString(36).slice(2)}`

/** Resolves once `pred()` holds (checked every 10 ms), rejects after `ms`. */
async function until(pred, ms = 5000) {
  const deadline = Date.now() + ms
  while (!pred()) {
    if (Date.now() > deadline) throw new Error("timed out")
    await new Promise((r) => setTimeout(r, 10))
  }
}

describe("@durable-streams/client against baton serve", () => {
  for (const live of ["sse", "long-poll"]) {
    test(`JSON stream: create, append, read live (${live}), resume`, async () => {
      const url = unique(`json-${live}`)
      const stream = await DurableStream.create({ url, contentType: "application/json" })
      await stream.append(JSON.stringify({ n: 1 }))

      // Live reader from the start: sees the existing message, then the live ones, in order.
      const res = await stream.stream({ live })
      const seen = []
      let lastOffset
      res.subscribeJson((batch) => {
        seen.push(...batch.items)
        lastOffset = batch.offset
      })
      await until(() => seen.length === 1)
      await stream.append(JSON.stringify({ n: 2 }))
      // (The client sends each append as a one-element batch: an array stays one message.)
      await stream.append(JSON.stringify([3, 4]))
      await until(() => seen.length === 3)
      res.cancel()
      expect(seen).toEqual([{ n: 1 }, { n: 2 }, [3, 4]])

      // Resume from the saved offset: only what came after, nothing twice.
      await stream.append(JSON.stringify({ n: 5 }))
      const resumed = await stream.stream({ offset: lastOffset, live: false })
      expect(await resumed.json()).toEqual([{ n: 5 }])
    }, 20000)
  }

  test("text stream: long-poll subscriber gets appends in order; close ends it", async () => {
    const url = unique("text")
    const stream = await DurableStream.create({ url, contentType: "text/plain" })
    const res = await stream.stream({ live: "long-poll" })
    let text = ""
    let closed = false
    res.subscribeText((chunk) => {
      text += chunk.text
      if (chunk.streamClosed) closed = true
    })
    for (const part of ["a", "b", "c"]) await stream.append(part)
    await stream.close()
    await until(() => closed)
    expect(text).toBe("abc")
    await res.closed
  }, 20000)

  test("idempotent producer: appends once each, closes, readers see EOF", async () => {
    const url = unique("producer")
    const stream = await DurableStream.create({ url, contentType: "application/json" })
    const producer = new IdempotentProducer(stream, "worker-1")
    for (let i = 0; i < 20; i++) producer.append(JSON.stringify({ i }))
    await producer.flush()
    await producer.close(JSON.stringify({ done: true }))
    const res = await stream.stream({ live: false })
    const items = await res.json()
    expect(items).toEqual([...Array.from({ length: 20 }, (_, i) => ({ i })), { done: true }])
    const head = await fetch(url, { method: "HEAD" })
    expect(head.headers.get("stream-closed")).toBe("true")
  }, 20000)
})
