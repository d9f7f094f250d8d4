// Follows /ui/api/events: server-sent events read with fetch (an EventSource cannot send the
// Authorization header), reconnecting with Last-Event-ID so no event is missed or repeated.
"use strict";

window.ShoalEvents = (() => {
  // Parses one SSE block ("id: ...\ndata: ..."): [id, data] or null for a comment.
  function parseBlock(block) {
    let id = 0;
    const data = [];
    for (const line of block.split("\n")) {
      if (line.startsWith("id:")) id = Number(line.slice(3).trim());
      else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
    }
    return data.length ? [id, data.join("\n")] : null;
  }

  // follow({headers, onEvent(id, event), onStatus(text)}) runs until the page closes;
  // returns reconnect(), which starts over at once (a new key).
  function follow(options) {
    let lastId = 0;
    let abort = null;
    let wake = null;

    // Waits `ms`, or less when woken.
    const pause = (ms) => new Promise((resolve) => {
      const timer = setTimeout(resolve, ms);
      wake = () => {
        clearTimeout(timer);
        resolve();
      };
    });

    async function run() {
      for (;;) {
        abort = new AbortController();
        try {
          const response = await fetch("/ui/api/events", {
            headers: options.headers(lastId ? { "Last-Event-ID": String(lastId) } : {}),
            signal: abort.signal,
            cache: "no-store",
          });
          if (response.status === 401 || response.status === 403) {
            options.onStatus("needs a key");
            await pause(30000); // or until a key is given
            continue;
          }
          if (!response.ok) throw new Error(String(response.status));
          options.onStatus("live");
          const reader = response.body.getReader();
          const decoder = new TextDecoder();
          let buffer = "";
          for (;;) {
            const { value, done } = await reader.read();
            if (done) break;
            buffer += decoder.decode(value, { stream: true });
            let end;
            while ((end = buffer.indexOf("\n\n")) >= 0) {
              const parsed = parseBlock(buffer.slice(0, end));
              buffer = buffer.slice(end + 2);
              if (!parsed) continue;
              try {
                options.onEvent(parsed[0], JSON.parse(parsed[1]));
              } catch (error) {
                console.warn("event not understood", error);
              }
              lastId = Math.max(lastId, parsed[0]);
            }
          }
        } catch (error) {
          if (error.name === "AbortError") continue; // reconnect(): at once
          options.onStatus("reconnecting…");
        }
        await pause(2000);
      }
    }

    run();
    return () => {
      if (abort) abort.abort();
      if (wake) wake();
    };
  }

  return { follow };
})();
