"use strict";
// Markdown to DOM nodes for model answers: fenced code, headings, lists, quotes, paragraphs, and inline
// code, bold, italic and http(s) links. Every piece of text becomes a text node (never HTML), so an
// answer holding <script> or an onerror attribute shows as the characters it is.
const craneMarkdown = (() => {
  const INLINE = /(`+)([\s\S]*?)\1|\*\*([^*]+)\*\*|__([^_]+)__|\*([^*\s][^*]*)\*|_([^_\s][^_]*)_|\[([^\]]+)\]\(([^)\s]+)\)/g;

  function el(tag, className) {
    const node = document.createElement(tag);
    if (className) node.className = className;
    return node;
  }

  function inline(parent, text) {
    let last = 0;
    for (const match of text.matchAll(INLINE)) {
      if (match.index > last) parent.append(document.createTextNode(text.slice(last, match.index)));
      last = match.index + match[0].length;
      if (match[1] !== undefined) {
        const code = el("code");
        code.textContent = match[2];
        parent.append(code);
      } else if (match[3] !== undefined || match[4] !== undefined) {
        const strong = el("strong");
        inline(strong, match[3] !== undefined ? match[3] : match[4]);
        parent.append(strong);
      } else if (match[5] !== undefined || match[6] !== undefined) {
        const em = el("em");
        inline(em, match[5] !== undefined ? match[5] : match[6]);
        parent.append(em);
      } else {
        const url = match[8];
        if (/^https?:\/\//i.test(url)) {
          const link = el("a");
          link.href = url;
          link.target = "_blank";
          link.rel = "noopener noreferrer";
          link.textContent = match[7];
          parent.append(link);
        } else {
          parent.append(document.createTextNode(match[0]));
        }
      }
    }
    if (last < text.length) parent.append(document.createTextNode(text.slice(last)));
  }

  function lines(parent, textLines) {
    textLines.forEach((line, i) => {
      if (i) parent.append(el("br"));
      inline(parent, line);
    });
  }

  function render(source) {
    const root = document.createDocumentFragment();
    const all = source.replace(/\r\n?/g, "\n").split("\n");
    let i = 0;
    while (i < all.length) {
      const line = all[i];
      const fence = line.match(/^\s*(```|~~~)\s*([\w+-]*)/);
      if (fence) {
        const body = [];
        i += 1;
        while (i < all.length && !all[i].trim().startsWith(fence[1])) body.push(all[i++]);
        i += 1;  // the closing fence (or the end of a still-streaming answer)
        const pre = el("pre");
        const code = el("code");
        if (fence[2]) code.dataset.language = fence[2];
        code.textContent = body.join("\n");
        pre.append(code);
        root.append(pre);
        continue;
      }
      if (!line.trim()) {
        i += 1;
        continue;
      }
      const heading = line.match(/^(#{1,6})\s+(.*)$/);
      if (heading) {
        const h = el("h" + Math.min(6, heading[1].length + 2));
        inline(h, heading[2]);
        root.append(h);
        i += 1;
        continue;
      }
      const item = /^\s*([-*+]|\d+[.)])\s+/;
      if (item.test(line)) {
        const ordered = /^\s*\d/.test(line);
        const list = el(ordered ? "ol" : "ul");
        while (i < all.length && item.test(all[i])) {
          const li = el("li");
          const body = [all[i].replace(item, "")];
          i += 1;
          while (i < all.length && all[i].trim() && !item.test(all[i]) && /^\s{2,}/.test(all[i])) body.push(all[i++].trim());
          lines(li, body);
          list.append(li);
        }
        root.append(list);
        continue;
      }
      if (/^\s*>/.test(line)) {
        const quote = el("blockquote");
        const body = [];
        while (i < all.length && /^\s*>/.test(all[i])) body.push(all[i++].replace(/^\s*>\s?/, ""));
        lines(quote, body);
        root.append(quote);
        continue;
      }
      const body = [];
      while (i < all.length && all[i].trim() && !/^\s*(```|~~~|#{1,6}\s|>|[-*+]\s|\d+[.)]\s)/.test(all[i])) body.push(all[i++]);
      if (!body.length) body.push(all[i++]);
      const p = el("p");
      lines(p, body);
      root.append(p);
    }
    return root;
  }

  return { render };
})();
