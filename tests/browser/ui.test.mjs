// The manual-test page of `hrm serve --ui`, driven in Debian's headless Chromium with
// playwright-core (which never downloads a browser of its own).
//
//   HRM_BIN=target/debug/hrm node --test tests/browser
//
// Set HRM_SCREENSHOT=docs/ui.png to also save a screenshot of the page after a generation.

import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { spawn } from 'node:child_process';
import { createServer } from 'node:net';
import { join, resolve, dirname } from 'node:path';
import { fileURLToPath } from 'node:url';
import { chromium } from 'playwright-core';

const root = resolve(dirname(fileURLToPath(import.meta.url)), '..', '..');
const hrm = resolve(root, process.env.HRM_BIN ?? 'target/debug/hrm');
const model = process.env.HRM_UI_MODEL ?? join(root, 'tests', 'fixtures', 'hrm-text-prefix');
const chromiumPath = process.env.CHROMIUM ?? '/usr/bin/chromium';

let server;
let browser;
let base;

function freePort() {
  return new Promise((ok, fail) => {
    const s = createServer();
    s.on('error', fail);
    s.listen(0, '127.0.0.1', () => {
      const { port } = s.address();
      s.close(() => ok(port));
    });
  });
}

async function waitReady(url) {
  for (let i = 0; i < 600; i++) {
    try {
      const r = await fetch(`${url}/readyz`);
      if (r.status === 200) return;
    } catch {}
    await new Promise((r) => setTimeout(r, 100));
  }
  throw new Error('hrm serve never became ready');
}

before(async () => {
  const port = await freePort();
  base = `http://127.0.0.1:${port}`;
  server = spawn(hrm, ['serve', '--ui', '--host', '127.0.0.1', '--port', String(port), '--model-path', model, '--device', 'cpu'], {
    stdio: ['ignore', 'ignore', 'inherit'],
  });
  await waitReady(base);
  // playwright-core gives each launch a fresh profile directory of its own.
  browser = await chromium.launch({
    executablePath: chromiumPath,
    headless: true,
    args: ['--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run',
      '--disable-background-networking', '--disable-component-update', '--disable-sync'],
  });
});

after(async () => {
  await browser?.close();
  server?.kill('SIGTERM');
});

test('Generate shows the completion and its usage', async () => {
  const page = await browser.newPage();
  await page.goto(`${base}/ui`);
  await page.fill('#prompt', 'It was a dark and stormy night');
  await page.locator('#max_tokens').fill('12');
  await page.locator('#temperature').fill('0');
  assert.equal(await page.textContent('#max_tokens_out'), '12');
  await page.click('#generate');
  await page.waitForFunction(() => document.querySelector('#usage').textContent.includes('total_tokens'));
  const usage = await page.textContent('#usage');
  const [, prompt, completion, total] = usage.match(/prompt_tokens (\d+) · completion_tokens (\d+) · total_tokens (\d+)/);
  assert.equal(Number(prompt) + Number(completion), Number(total));
  assert.ok(Number(completion) >= 1 && Number(completion) <= 12, usage);
  // The page shows what the API returns for the same request.
  const api = await (await fetch(`${base}/generate`, {
    method: 'POST',
    headers: { 'Content-Type': 'application/json' },
    body: JSON.stringify({ prompts: ['It was a dark and stormy night'], max_tokens: 12, temperature: 0, top_p: 1 }),
  })).json();
  assert.equal(await page.textContent('#output'), api.completions[0]);
  if (process.env.HRM_SCREENSHOT) {
    await page.screenshot({ path: resolve(root, process.env.HRM_SCREENSHOT), fullPage: true });
  }
  await page.close();
});

test('Score shows the log-likelihood of the continuation', async () => {
  const page = await browser.newPage();
  await page.goto(`${base}/ui`);
  await page.fill('#prompt', 'It was a dark and stormy');
  await page.fill('#continuation', ' night');
  await page.click('#score');
  await page.waitForFunction(() => document.querySelector('#output').textContent.startsWith('log p'));
  const shown = Number((await page.textContent('#output')).split('=')[1]);
  const api = await (await fetch(`${base}/loglikelihood`, {
    method: 'POST',
    headers: { 'Content-Type': 'application/json' },
    body: JSON.stringify({ prompts: ['It was a dark and stormy'], continuations: [' night'] }),
  })).json();
  assert.ok(Math.abs(shown - api.ll[0]) < 1e-3, `${shown} vs ${api.ll[0]}`);
  await page.close();
});

test('Errors from the API are shown, not swallowed', async () => {
  const page = await browser.newPage();
  await page.goto(`${base}/ui`);
  await page.fill('#prompt', '');
  await page.click('#generate');
  await page.waitForFunction(() => document.querySelector('#output').classList.contains('error'));
  assert.match(await page.textContent('#output'), /prompts\[0\] is empty/);
  await page.close();
});
