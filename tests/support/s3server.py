"""A real S3 server for tests: moto's, in this process, on a free port.

Tests talk to it through s3fs over HTTP, as a job talks to S3; nothing of
s3fs or boto is replaced. Each test gets a bucket of its own.
"""

import contextlib
import os
import re
import socket
import subprocess
import sys
import threading
import time
import uuid

import s3fs
from moto.server import ThreadedMotoServer

CREDENTIALS = {'key': 'testing', 'secret': 'testing'}
# the same, for the environment of the processes a test launches
S3_ENV = {'AWS_ACCESS_KEY_ID': 'testing', 'AWS_SECRET_ACCESS_KEY': 'testing',
          'AWS_DEFAULT_REGION': 'us-east-1'}


def start_server():
    """A started moto server and its endpoint URL; stop it with ``server.stop()``."""
    server = ThreadedMotoServer(ip_address='127.0.0.1', port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    return server, f'http://{host}:{port}'


def filesystem(endpoint_url):
    """An s3fs filesystem on the server at ``endpoint_url`` (no cached instance)."""
    return s3fs.S3FileSystem(client_kwargs={'endpoint_url': endpoint_url},
                             skip_instance_cache=True, **CREDENTIALS)


def new_bucket(fs):
    """A fresh, empty bucket on ``fs``'s server; its name."""
    name = f'test-{uuid.uuid4().hex[:12]}'
    fs.mkdir(name)
    return name


# the first line of an HTTP request, as a chunk that begins one starts
_REQUEST_LINE = re.compile(rb'(?:GET|PUT|POST|DELETE|HEAD) /\S* HTTP/1\.[01](?=\r\n)')


class Proxy:
    """The network between a job and a server: a TCP proxy on a free port
    of 127.0.0.1 that forwards to ``port``, and that a test can cut.

    Once cut, every connection through it is closed and new ones are
    refused (nothing listens on its port), as when the network is down;
    :meth:`restore` listens on the same port again. With ``cut_on`` (a
    regular expression of bytes), the proxy cuts itself when a request
    matches it, before forwarding it; with ``drop_on``, it drops every
    request that matches, each retry too, and forwards the others; with
    ``delay_on`` (a pattern and seconds), it holds each request that
    matches that long before forwarding it, a slow network, listing each
    one's request line in ``delayed`` as it begins to hold it. Each sets
    ``fired`` when it acts. ``requests`` lists the request line of every
    request it forwarded (``b'PUT /bucket/key HTTP/1.1'``). :meth:`silence`
    makes it an endpoint that accepts connections and reads requests but
    never answers.
    """

    def __init__(self, port):
        self.target = port
        self.cut_on = None
        self.drop_on = None
        self.delay_on = None
        self.requests = []
        self.delayed = []
        self.silent = False
        self.on_request = None
        self.fired = threading.Event()
        self._lock = threading.Lock()
        self._sockets = set()
        self._listener = None
        self.port = None
        self.restore()

    @property
    def endpoint(self):
        return f'http://127.0.0.1:{self.port}'

    def restore(self):
        """Accept connections (again, on the same port)."""
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(('127.0.0.1', self.port or 0))
        listener.listen()
        self.port = listener.getsockname()[1]
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def silence(self):
        """From now on, read every request and answer none."""
        self.silent = True

    def cut(self):
        """Close every connection and stop listening."""
        with self._lock:
            self._listener.close()
            for sock in self._sockets:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()
            self._sockets.clear()

    def _accept(self, listener):
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # cut
            server = socket.create_connection(('127.0.0.1', self.target))
            with self._lock:
                self._sockets |= {client, server}
            # what to do at the next answer on this connection
            at_answer = []
            threading.Thread(target=self._forward, args=(client, server, True, at_answer),
                             daemon=True).start()
            threading.Thread(target=self._forward, args=(server, client, False, at_answer),
                             daemon=True).start()

    def _forward(self, source, target, request, at_answer):
        requests = Requests()
        try:
            while data := source.recv(1 << 16):
                if request and self.cut_on is not None and re.search(self.cut_on, data):
                    self.cut_on = None
                    self.fired.set()
                    self.cut()
                    return
                if request and self.silent:
                    self.fired.set()
                    continue
                if request and self.drop_on is not None and re.search(self.drop_on, data):
                    self.fired.set()
                    return
                delay = self.delay_on
                if request and delay is not None and re.search(delay[0], data):
                    line = _REQUEST_LINE.match(data)
                    self.delayed.append(line.group(0) if line else data[:80])
                    self.fired.set()
                    time.sleep(delay[1])
                if request and (line := _REQUEST_LINE.match(data)):
                    self.requests.append(line.group(0))
                if not request and at_answer:
                    at_answer.pop()()
                    return
                # queued before the request goes on, so that its answer, which
                # may come back before this thread runs again, finds it
                if request and self.on_request is not None:
                    for line in requests.feed(data):
                        action = self.on_request(line)
                        if action is not None:
                            at_answer.append(action)
                target.sendall(data)
        except OSError:
            pass  # cut, or closed by the other side
        finally:
            for sock in (source, target):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)


class Requests:
    """Splits what a client sends into HTTP/1.1 requests, framed by their
    ``Content-Length`` (what botocore sends; a chunked body is refused)."""

    def __init__(self):
        self.head = b''
        self.body_left = 0
        self.line = None

    def feed(self, data):
        """The first lines of the requests that ``data`` completes."""
        done = []
        while data:
            if self.body_left:
                taken = min(len(data), self.body_left)
                data, self.body_left = data[taken:], self.body_left - taken
                if not self.body_left:
                    done.append(self.line)
                continue
            self.head += data
            data = b''
            end = self.head.find(b'\r\n\r\n')
            if end < 0:
                break
            head, data, self.head = self.head[:end], self.head[end + 4:], b''
            self.line = head.split(b'\r\n', 1)[0]
            headers = dict(line.split(b':', 1) for line in head.split(b'\r\n')[1:] if b':' in line)
            headers = {key.strip().lower(): value.strip() for key, value in headers.items()}
            if b'chunked' in headers.get(b'transfer-encoding', b''):
                raise ValueError(f"a chunked request: {self.line!r}")
            self.body_left = int(headers.get(b'content-length', 0))
            if not self.body_left:
                done.append(self.line)
        return done


def free_port():
    with socket.socket() as sock:
        sock.bind(('127.0.0.1', 0))
        return sock.getsockname()[1]


def start_auth_server():
    """A moto server in a subprocess that refuses unknown credentials (it
    checks signatures: ``INITIAL_NO_AUTH_ACTION_COUNT=0``); the process and
    its endpoint URL. Stop it with ``process.kill()``."""
    port = free_port()
    moto_server = os.path.join(os.path.dirname(sys.executable), 'moto_server')
    process = subprocess.Popen(
        [moto_server, '-H', '127.0.0.1', '-p', str(port)],
        env=dict(os.environ, INITIAL_NO_AUTH_ACTION_COUNT='0'),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(('127.0.0.1', port), timeout=1).close()
            return process, f'http://127.0.0.1:{port}'
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                raise RuntimeError(f"moto_server did not start on port {port}") from None
            time.sleep(0.1)
