// The hub's dashboard, driven in Debian's headless Chromium with playwright-core. The Rust
// test crates/hrm-cli/tests/hub.rs starts `hrm hub serve` over a prepared network (versions
// with metrics, a worker past the 1K badge) and runs this file with HRM_HUB_URL set:
//
//   HRM_HUB_URL=http://127.0.0.1:8090 node --test tests/browser/dashboard.test.mjs
//
// Set HRM_SCREENSHOT=docs/dashboard.png to also save a screenshot.

import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { resolve, dirname } from 'node:path';
import { fileURLToPath } from 'node:url';
import { chromium } from 'playwright-core';

const root = resolve(dirname(fileURLToPath(import.meta.url)), '..', '..');
const base = process.env.HRM_HUB_URL;
const chromiumPath = process.env.CHROMIUM ?? '/usr/bin/chromium';
let browser;

before(async () => {
  assert.ok(base, 'HRM_HUB_URL must name a running hub');
  browser = await chromium.launch({
    executablePath: chromiumPath,
    headless: true,
    args: ['--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run',
      '--disable-background-networking', '--disable-component-update', '--disable-sync'],
  });
});

after(async () => { await browser?.close(); });

test('the dashboard shows the network stats the API reports', async () => {
  const stats = await (await fetch(`${base}/api/v1/stats/global`)).json();
  const page = await browser.newPage();
  await page.goto(base);
  await page.waitForFunction((v) => document.querySelector('#version').textContent === v, stats.current_version);
  assert.equal(await page.textContent('#versions'), String(stats.num_versions));
  assert.equal(await page.textContent('#updates-aggregated'), stats.updates_aggregated.toLocaleString('en'));
  assert.equal(await page.textContent('#tokens'), stats.total_tokens.toLocaleString('en'));
  await page.close();
});

test('the loss curve has one point per version with metrics', async () => {
  const versions = await (await fetch(`${base}/api/v1/model/versions`)).json();
  const withLoss = versions.filter((v) => v.metrics.valid_loss != null);
  assert.ok(withLoss.length >= 2, 'the prepared hub has at least two evaluated versions');
  const page = await browser.newPage();
  await page.goto(base);
  await page.waitForSelector('#loss-chart polyline[data-series="valid_loss"]');
  const points = await page.getAttribute('#loss-chart polyline[data-series="valid_loss"]', 'points');
  assert.equal(points.trim().split(/\s+/).length, withLoss.length);
  assert.match(await page.textContent('#loss-note'), new RegExp(`latest ${versions.at(-1).version.replaceAll('.', '\\.')}`));
  await page.close();
});

test('the leaderboard ranks workers and shows badges', async () => {
  const board = await (await fetch(`${base}/api/v1/leaderboard`)).json();
  const page = await browser.newPage();
  await page.goto(base);
  await page.waitForFunction((n) => document.querySelectorAll('#leaderboard tr').length === n, board.length);
  const first = await page.locator('#leaderboard tr').first().textContent();
  assert.ok(first.includes(board[0].username), first);
  assert.deepEqual(await page.locator('#leaderboard tr').first().locator('.badge').allTextContents(), board[0].badges);
  assert.ok(board[0].badges.includes('1K'));
  await page.close();
});

test('the live feed connects and reports new versions', async () => {
  const page = await browser.newPage();
  await page.goto(base);
  await page.waitForFunction(() => document.querySelector('#status').textContent === 'live');
  if (process.env.HRM_SCREENSHOT) {
    await page.screenshot({ path: resolve(root, process.env.HRM_SCREENSHOT), fullPage: true });
  }
  await page.close();
});
