"""A real S3 server for tests: moto's, in this process, on a free port.

Tests talk to it through s3fs over HTTP, as a job talks to S3; nothing of
s3fs or boto is replaced. Each test gets a bucket of its own.
"""

import uuid

import s3fs
from moto.server import ThreadedMotoServer

CREDENTIALS = {'key': 'testing', 'secret': 'testing'}


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
