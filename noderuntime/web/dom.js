// Helpers the pages share. Data only ever enters the page as text: `el` appends strings as
// text nodes and sets attributes by name, so a model name or a reply cannot become markup.

/**
 * A new element. `props`: `class`, `dataset` (an object), `style` (CSS properties), `on`
 * (event handlers), or attribute names (true: present, false/null/undefined: absent).
 * `children`: nodes, or strings and numbers, which become text.
 */
export function el(tag, props = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(props)) {
    if (value === undefined || value === null || value === false) continue;
    if (name === "class") node.className = value;
    else if (name === "dataset") {
      for (const [key, data] of Object.entries(value)) node.dataset[key] = String(data);
    } else if (name === "style") {
      for (const [property, setting] of Object.entries(value)) node.style.setProperty(property, setting);
    } else if (name === "on") {
      for (const [event, handler] of Object.entries(value)) node.addEventListener(event, handler);
    } else node.setAttribute(name, value === true ? "" : String(value));
  }
  for (const child of children.flat()) {
    if (child === undefined || child === null || child === false) continue;
    node.append(child instanceof Node ? child : String(child));
  }
  return node;
}

/** The first characters of a hex node id: enough to tell nodes apart on a page. */
export function shortId(hex) {
  return String(hex).slice(0, 12);
}

/** `seconds` ago, in words a reader takes in at a glance. */
export function ago(seconds) {
  if (seconds < 10) return `${seconds.toFixed(1)} s ago`;
  if (seconds < 120) return `${Math.round(seconds)} s ago`;
  if (seconds < 7200) return `${Math.round(seconds / 60)} min ago`;
  return `${Math.round(seconds / 3600)} h ago`;
}

/** A rate or a time, with no more digits than a reader can use. */
export function figure(value) {
  if (!Number.isFinite(value)) return "–";
  if (value >= 100) return String(Math.round(value));
  if (value >= 10) return value.toFixed(1);
  return value.toFixed(2);
}

/** "1 node", "2 nodes". */
export function count(n, one, many = `${one}s`) {
  return `${n} ${n === 1 ? one : many}`;
}
