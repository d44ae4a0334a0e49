// A sandbox's forwarder: 127.0.0.1:PORT inside the sandbox -> the sample's Unix socket.
//
// Run as `node forward.js SOCKET PORT serve` (a container's entrypoint: it stays in front), or
// without `serve` to start a detached copy of itself and return once that copy listens. Once it
// listens it says so to the host: it connects to the socket once and closes without a byte. Each
// TCP connection is passed to the socket, byte for byte, both ways, half-closes included.
// `forward.py` is the same for images with python3 and no node of ours.
'use strict';
const net = require('net');
const { spawn } = require('child_process');

const [socketPath, port, role] = process.argv.slice(2);

if (role !== 'serve') {
  const child = spawn(process.execPath, [__filename, socketPath, port, 'serve'], {
    detached: true,
    stdio: ['ignore', 'pipe', 'ignore'],
  });
  child.stdout.once('data', () => {
    child.stdout.destroy();
    child.unref();
    process.exit(0);
  });
  child.on('exit', (code) => process.exit(code || 1));
} else {
  const server = net.createServer({ allowHalfOpen: true, noDelay: true }, (client) => {
    const up = net.connect({ path: socketPath, allowHalfOpen: true });
    const done = () => { client.destroy(); up.destroy(); };
    client.on('error', done);
    up.on('error', done);
    client.pipe(up);
    up.pipe(client);
    client.on('close', () => up.end());
    up.on('close', () => client.end());
  });
  server.on('error', (e) => { process.stderr.write(String(e) + '\n'); process.exit(2); });
  server.listen(Number(port), '127.0.0.1', () => {
    const hello = net.connect({ path: socketPath }, () => hello.end());
    hello.on('error', () => {});
    process.stdout.write('ready\n');
  });
}
