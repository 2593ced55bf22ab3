// A small markdown renderer for the chat page's answers. It builds DOM nodes and sets only textContent, never
// HTML, so whatever a model writes (<script>, <img onerror=...>) shows as text; links keep http(s) and mailto
// targets only. Nothing is loaded from elsewhere: the page works where the server has no internet.
// Covers what chat models write: paragraphs, line breaks, headings, fenced and inline code, bold, italics,
// links, bullet and numbered lists, block quotes, rules and pipe tables. An unclosed fence (an answer still
// streaming) renders as code up to the end.
"use strict";

const SAFE_LINK = /^(https?:\/\/|mailto:)/i;
// Code spans first (their text is literal), then links, bold, italics; `_` only outside words (snake_case stays).
const INLINE = /(`+)([^`]|[^`][\s\S]*?[^`])\1(?!`)|\[([^\]\n]+)\]\(([^()\s]+)\)|\*\*(?=\S)([^*\n]*?\S)\*\*|(?<!\w)__(?=\S)([^_\n]*?\S)__(?!\w)|\*(?=[^\s*])([^*\n]*?[^\s*])\*|(?<!\w)_(?=[^\s_])([^_\n]*?[^\s_])_(?!\w)/g;
const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([\w+#.-]*)[^`]*$/;
const HEADING = /^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$/;
const BULLET = /^ {0,3}[-*+]\s+(.*)$/;
const NUMBERED = /^ {0,3}(\d{1,9})[.)]\s+(.*)$/;
const QUOTE = /^ {0,3}>\s?(.*)$/;
const RULE = /^ {0,3}([-*_])(\s*\1){2,}\s*$/;
const TABLE_RULE = /^\s*\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)*\|?\s*$/;

function node(tag, parent, text) {
  const element = document.createElement(tag);
  if (text !== undefined) element.textContent = text;
  if (parent) parent.appendChild(element);
  return element;
}

function renderInline(text, parent) {
  let last = 0;
  for (const match of text.matchAll(INLINE)) {
    if (match.index > last) parent.appendChild(document.createTextNode(text.slice(last, match.index)));
    const [whole, ticks, code, label, href, bold1, bold2, em1, em2] = match;
    if (ticks) {
      node("code", parent, code.length > 2 && code.startsWith(" ") && code.endsWith(" ") ? code.slice(1, -1) : code);
    } else if (label !== undefined) {
      if (SAFE_LINK.test(href)) {
        const link = node("a", parent);
        link.href = href;
        link.target = "_blank";
        link.rel = "noopener noreferrer nofollow";
        renderInline(label, link);
      } else {
        parent.appendChild(document.createTextNode(whole));  // javascript:, data: and relative targets: as written
      }
    } else if (bold1 !== undefined || bold2 !== undefined) {
      renderInline(bold1 ?? bold2, node("strong", parent));
    } else {
      renderInline(em1 ?? em2, node("em", parent));
    }
    last = match.index + whole.length;
  }
  if (last < text.length) parent.appendChild(document.createTextNode(text.slice(last)));
}

// Lines of one paragraph: joined with line breaks, as a chat answer's single newlines are meant.
function renderLines(lines, parent) {
  lines.forEach((line, index) => {
    if (index) node("br", parent);
    renderInline(line.trim(), parent);
  });
}

function cells(line) {
  return line.trim().replace(/^\|/, "").replace(/\|$/, "").split("|").map((cell) => cell.trim());
}

function startsBlock(line, next) {
  return FENCE.test(line) || HEADING.test(line) || BULLET.test(line) || NUMBERED.test(line) || QUOTE.test(line) ||
    RULE.test(line) || (line.includes("|") && next !== undefined && TABLE_RULE.test(next) && next.includes("-"));
}

function renderBlocks(lines, parent) {
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    if (!line.trim()) { i++; continue; }
    let match;
    if ((match = line.match(FENCE))) {
      const code = [];
      for (i++; i < lines.length && !lines[i].trim().startsWith(match[1]); i++) code.push(lines[i]);
      i++;  // the closing fence (none yet while the answer streams)
      const block = node("code", node("pre", parent), code.join("\n"));
      if (match[2]) block.dataset.lang = match[2];
    } else if ((match = line.match(HEADING))) {
      renderInline(match[2], node(`h${Math.min(match[1].length + 2, 6)}`, parent));  // # is h3: answers, not pages
      i++;
    } else if (RULE.test(line)) {
      node("hr", parent);
      i++;
    } else if (QUOTE.test(line)) {
      const quoted = [];
      for (; i < lines.length && (match = lines[i].match(QUOTE)); i++) quoted.push(match[1]);
      renderBlocks(quoted, node("blockquote", parent));
    } else if (BULLET.test(line) || NUMBERED.test(line)) {
      const ordered = !BULLET.test(line);
      const pattern = ordered ? NUMBERED : BULLET;
      const list = node(ordered ? "ol" : "ul", parent);
      if (ordered && Number(line.match(NUMBERED)[1]) !== 1) list.start = Number(line.match(NUMBERED)[1]);
      let item = null;
      for (; i < lines.length; i++) {
        const current = lines[i];
        if ((match = current.match(pattern))) {
          item = [match[ordered ? 2 : 1]];
          renderLines(item, node("li", list));
        } else if (item && current.trim() && /^\s+/.test(current) && !startsBlock(current.trim())) {
          const li = list.lastChild;  // an indented continuation of the item above
          node("br", li);
          renderInline(current.trim(), li);
        } else {
          break;
        }
      }
    } else if (line.includes("|") && i + 1 < lines.length && TABLE_RULE.test(lines[i + 1]) && lines[i + 1].includes("-")) {
      const table = node("table", parent);
      renderCells(cells(line), node("tr", node("thead", table)), "th");
      const body = node("tbody", table);
      for (i += 2; i < lines.length && lines[i].includes("|") && lines[i].trim(); i++) {
        renderCells(cells(lines[i]), node("tr", body), "td");
      }
    } else {
      const paragraph = [];
      for (; i < lines.length && lines[i].trim() && !(paragraph.length && startsBlock(lines[i], lines[i + 1])); i++) {
        paragraph.push(lines[i]);
      }
      renderLines(paragraph, node("p", parent));
    }
  }
}

function renderCells(values, row, tag) {
  for (const value of values) renderInline(value, node(tag, row));
}

// Replace `target`'s content with `source` rendered.
function renderMarkdown(source, target) {
  target.replaceChildren();
  renderBlocks(String(source).replace(/\r\n?/g, "\n").split("\n"), target);
}

window.renderMarkdown = renderMarkdown;
