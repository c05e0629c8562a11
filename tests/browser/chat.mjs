// Drives llama-server's chat page in Debian's Chromium, as a user would:
// types each message into the page, sends it with Enter, and waits for the
// streamed answer or the error the page shows. Run by tests/it/browser.rs.
//
//   node chat.mjs CONFIG.json
//
// CONFIG: { url, chromium, playwright (the playwright-core directory),
//           shots (a directory), turns: [{ message, fault_file?, fault }] }
// A turn with `fault` creates `fault_file` before it is sent (the server's
// reads fail while it exists) and every other turn removes it.
// Prints one JSON object: for each turn, the request the page sent, the
// response's status, the answer as streamed (its content deltas), the text
// the page shows for it, the error the page shows, if any, and the progress
// lines it showed with sdq's figures while the prompt was computed.
import { createRequire } from 'node:module';
import fs from 'node:fs';
import path from 'node:path';

// Windows-1252's characters at bytes 0x80-0x9f (the rest are Latin-1's).
const WINDOWS_1252 = new Map(
	[0x20ac, 0, 0x201a, 0x192, 0x201e, 0x2026, 0x2020, 0x2021, 0x2c6, 0x2030, 0x160, 0x2039, 0x152, 0, 0x17d, 0,
	 0, 0x2018, 0x2019, 0x201c, 0x201d, 0x2022, 0x2013, 0x2014, 0x2dc, 0x2122, 0x161, 0x203a, 0x153, 0, 0x17e, 0x178]
		.map((c, i) => [c, 0x80 + i])
		.filter(([c]) => c !== 0)
);

const config = JSON.parse(fs.readFileSync(process.argv[2], 'utf8'));
const require = createRequire(path.join(config.playwright, 'package.json'));
const { chromium } = require(config.playwright);

// The flags a closed network needs: no background connections to fail.
const browser = await chromium.launch({
	executablePath: config.chromium,
	args: [
		'--no-sandbox',
		'--disable-gpu',
		'--disable-quic',
		'--no-first-run',
		'--disable-background-networking',
		'--disable-component-update',
		'--disable-sync'
	]
});
const results = [];
try {
	const page = await browser.newPage({ viewport: { width: 1280, height: 900 } });
	const console_lines = [];
	page.on('console', (m) => console_lines.push(`${m.type()}: ${m.text()}`));
	await page.goto(config.url);
	const input = page.locator('textarea[placeholder="Type a message..."]');
	await input.waitFor({ timeout: 30000 });

	for (const [i, turn] of config.turns.entries()) {
		if (turn.fault) fs.writeFileSync(turn.fault_file, '');
		else if (turn.fault_file) fs.rmSync(turn.fault_file, { force: true });

		const responded = page.waitForResponse(
			(r) => r.url().endsWith('/v1/chat/completions') && r.request().method() === 'POST',
			{ timeout: 120000 }
		);
		await input.fill(turn.message);
		await input.press('Enter');
		// The page's progress lines while the prompt is computed (sdq adds the
		// experts read to them), polled until the answer is complete.
		const progressShown = [];
		let polling = true;
		const poller = (async () => {
			while (polling) {
				const texts = await page.locator('.shimmer-text').allInnerTexts().catch(() => []);
				for (const t of texts.map((x) => x.trim())) {
					if (t.includes('experts read') && !progressShown.includes(t)) progressShown.push(t);
				}
				await page.waitForTimeout(20);
			}
		})();
		const response = await responded;
		const body = asSent(await response.text());
		polling = false;
		await poller;
		const result = {
			message: turn.message,
			request: JSON.parse(response.request().postData()),
			status: response.status(),
			streamed: streamedContent(body),
			stream_error: streamError(body),
			shown: null,
			error_shown: null,
			progress_shown: progressShown
		};

		if (turn.fault) {
			const dialog = page.getByRole('alertdialog').or(page.getByRole('dialog'));
			await dialog.first().waitFor({ timeout: 30000 });
			result.error_shown = (await dialog.first().innerText()).trim();
			await page.screenshot({ path: path.join(config.shots, `turn-${i + 1}-error.png`) });
			await dialog.first().getByRole('button', { name: 'Close' }).click();
			await dialog.first().waitFor({ state: 'hidden', timeout: 10000 });
		} else {
			// The answer is shown once the page has rendered the last delta.
			const answer = page.locator('.chat-message-assistant .markdown-content').last();
			const want = normalize(result.streamed);
			const deadline = Date.now() + 30000;
			let shown = '';
			while (Date.now() < deadline) {
				shown = normalize(await answer.innerText().catch(() => ''));
				if (shown === want) break;
				await page.waitForTimeout(100);
			}
			result.shown = shown;
			await page.screenshot({ path: path.join(config.shots, `turn-${i + 1}.png`) });
		}
		results.push(result);
	}
	fs.writeFileSync(path.join(config.shots, 'console.txt'), console_lines.join('\n'));
} finally {
	await browser.close();
}
process.stdout.write(JSON.stringify({ turns: results }));

/**
 * The body as the server sent it (UTF-8). Chromium hands DevTools, and so
 * Playwright, an event stream without a charset decoded as Windows-1252,
 * which makes any non-ASCII answer mojibake; each character is mapped back
 * to its byte. A body with a character Windows-1252 has not was decoded
 * right already, and is returned as it is.
 */
function asSent(text) {
	const bytes = [];
	for (const ch of text) {
		const c = ch.codePointAt(0);
		// Latin-1's characters (and the five bytes Windows-1252 leaves undefined,
		// passed through as themselves) are their bytes.
		const b = c <= 0xff ? c : WINDOWS_1252.get(c);
		if (b === undefined) return text;
		bytes.push(b);
	}
	return new TextDecoder('utf-8').decode(Uint8Array.from(bytes));
}

/** The answer's text: the SSE stream's content deltas, joined. */
function streamedContent(body) {
	let text = '';
	for (const event of sseEvents(body)) {
		const content = event.choices?.[0]?.delta?.content;
		if (typeof content === 'string') text += content;
	}
	return text;
}

/** The message of an error event in the stream, if one ended it. */
function streamError(body) {
	for (const event of sseEvents(body)) {
		if (event.error) return event.error.message ?? JSON.stringify(event.error);
	}
	return null;
}

function* sseEvents(body) {
	for (const line of body.split('\n')) {
		if (!line.startsWith('data: ')) continue;
		const data = line.slice(6).trim();
		if (data === '[DONE]') continue;
		try {
			yield JSON.parse(data);
		} catch {
			// a line that is not JSON (a ping) carries no answer
		}
	}
}

/** The page renders the answer as Markdown: compare words, not spacing. */
function normalize(text) {
	return text.replace(/\s+/g, ' ').trim();
}
