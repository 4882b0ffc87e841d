// strata dashboard: the server's API key, for a server started with --api-key. The page and its files answer
// without it; the data routes it polls need `Authorization: Bearer KEY`. The key comes from the address's fragment
// (/dashboard#key=KEY: a browser never sends the fragment to the server, and this script removes it from the
// address bar at once) or from the form the page shows when the server answers 401. It is kept in the tab's
// sessionStorage (gone when the tab closes), never in the address, a cookie or a query string.
// Loaded before dashboard.js, which asks window.strataAuth for the headers of each poll.
"use strict";

(function () {
  const STORE = "strata.apiKey";
  let held = null;  // the key, when sessionStorage cannot be used (storage disabled): this page's lifetime only

  // what the server accepts (strata serve checks its key the same way): printable ASCII without spaces
  const valid = (key) => typeof key === "string" && /^[\x21-\x7e]+$/.test(key);

  function key() {
    try { return sessionStorage.getItem(STORE) || held; } catch (e) { return held; }
  }
  function keep(value) {
    held = value;
    try {
      if (value) sessionStorage.setItem(STORE, value);
      else sessionStorage.removeItem(STORE);
      held = null;
    } catch (e) { /* storage disabled: `held` has it */ }
  }

  // #key=KEY (among other fragment parts, if any): take it, then drop it from the address and the tab's history entry.
  // Split by hand rather than URLSearchParams, which would turn a "+" of the key into a space.
  function takeFromFragment() {
    const parts = location.hash.replace(/^#/, "").split("&").filter(Boolean);
    const rest = parts.filter((p) => !p.startsWith("key="));
    if (rest.length === parts.length) return;
    const raw = parts.find((p) => p.startsWith("key=")).slice(4);
    let value = raw;
    try { value = decodeURIComponent(raw); } catch (e) { /* not percent-encoded: as given */ }
    history.replaceState(history.state, "", location.pathname + location.search + (rest.length ? "#" + rest.join("&") : ""));
    if (valid(value)) keep(value);
  }
  takeFromFragment();

  let waiting = null;  // {promise, resolve} while the form is shown

  function form() {
    const f = document.getElementById("key-form");
    if (f && !f.dataset.ready) {
      f.dataset.ready = "1";
      f.addEventListener("submit", (event) => {
        event.preventDefault();
        const input = document.getElementById("key-input");
        const value = input.value.trim();
        if (!valid(value)) {
          document.getElementById("key-error").textContent = "an API key is printable ASCII without spaces";
          return;
        }
        input.value = "";
        keep(value);
        f.hidden = true;
        const w = waiting;
        waiting = null;
        if (w) w.resolve();
      });
    }
    return f;
  }

  window.strataAuth = {
    /** The headers that carry the key on a poll: {Authorization: "Bearer KEY"}, or {} without a key. */
    headers() {
      const k = key();
      return k ? { Authorization: "Bearer " + k } : {};
    },
    /** The server answered 401: forget the key it refused (if any), show the form; resolves once a key is given. */
    refused() {
      if (waiting) return waiting.promise;
      const had = key() !== null;
      keep(null);
      const f = form();
      if (!f) return new Promise(() => {});  // no form on this page: nothing more to try
      document.getElementById("key-error").textContent = had ? "the server refused this key" : "";
      document.body.dataset.keyRefused = had ? "1" : "0";
      f.hidden = false;
      document.getElementById("key-input").focus();
      let resolve;
      const promise = new Promise((r) => { resolve = r; });
      waiting = { promise, resolve };
      return promise;
    },
  };
})();
