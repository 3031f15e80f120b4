"""A local S3-protocol server that checks Signature Version 4: moto's server (a test
dependency) in its own process, with request authentication on.

The server runs with ``INITIAL_NO_AUTH_ACTION_COUNT=3``: its first three requests (create an
IAM user, give it an ``s3:*`` policy, create its access key) pass unsigned; every later one
must be signed by a key it issued, or it answers 403 (``SignatureDoesNotMatch`` for a wrong
secret, ``InvalidAccessKeyId`` for an unknown key). The bucket is made and filled with
boto3 signed by that key. ``requests()`` is the server's own request log (method, path,
status), read after a marker request so that every earlier request is in it.

Run as ``python -m tests.worker.s3_server``: prints the port, serves until stdin closes.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import TracebackType
from typing import IO, Any

import httpx

from omnistage_worker.sigv4 import Credentials

_LINE = re.compile(r'"(?:\x1b\[[0-9;]*m)*([A-Z]+) (\S+) HTTP/[0-9.]+(?:\x1b\[[0-9;]*m)*" (\d+)')
POLICY = {
    "Version": "2012-10-17",
    "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}],
}


def _serve() -> None:
    os.environ["INITIAL_NO_AUTH_ACTION_COUNT"] = "3"  # read when moto is imported
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    print(server.get_host_and_port()[1], flush=True)
    sys.stdin.read()
    server.stop()


class LocalS3:
    """The server and a bucket; ``url``, ``bucket`` and ``keys`` once entered."""

    def __init__(self, bucket: str = "models") -> None:
        self.bucket = bucket
        self.url = ""
        self.keys = Credentials("", "")
        self._proc: subprocess.Popen[str] | None = None
        self._log: list[str] = []
        self._seen = threading.Condition()
        self._marks = itertools.count()
        self._s3: Any = None

    def __enter__(self) -> LocalS3:
        root = Path(__file__).resolve().parents[2]
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "tests.worker.s3_server"],
            cwd=root,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert self._proc.stdout is not None and self._proc.stderr is not None
        port = self._proc.stdout.readline().strip()
        if not port.isdigit():
            self.stop()
            raise RuntimeError(f"the S3 server did not start: {port!r}")
        threading.Thread(target=self._read, args=(self._proc.stderr,), daemon=True).start()
        self.url = f"http://127.0.0.1:{port}"
        self._setup()
        return self

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            with self._seen:
                self._log.append(line)
                self._seen.notify_all()

    def _client(self, service: str, keys: Credentials) -> Any:
        import boto3

        return boto3.client(
            service,
            endpoint_url=self.url,
            region_name="us-east-1",
            aws_access_key_id=keys.access_key_id,
            aws_secret_access_key=keys.secret_access_key,
        )

    def _setup(self) -> None:
        iam = self._client("iam", Credentials("setup", "setup"))  # the 3 unsigned requests
        iam.create_user(UserName="fetcher")
        iam.put_user_policy(UserName="fetcher", PolicyName="s3", PolicyDocument=json.dumps(POLICY))
        key = iam.create_access_key(UserName="fetcher")["AccessKey"]
        self.keys = Credentials(key["AccessKeyId"], key["SecretAccessKey"])
        self._s3 = self._client("s3", self.keys)
        self._s3.create_bucket(Bucket=self.bucket)

    def put(self, key: str, data: bytes) -> None:
        self._s3.put_object(Bucket=self.bucket, Key=key, Body=data)

    def put_dir(self, prefix: str, directory: Path) -> int:
        """Upload every file under ``directory`` as ``prefix/relative path``: the count."""
        files = [p for p in sorted(directory.rglob("*")) if p.is_file()]
        for path in files:
            self.put(f"{prefix}/{path.relative_to(directory).as_posix()}", path.read_bytes())
        return len(files)

    def delete(self, key: str) -> None:
        self._s3.delete_object(Bucket=self.bucket, Key=key)

    def requests(self, timeout: float = 30) -> list[tuple[str, str, int]]:
        """Every request the server has answered so far: (method, path, status)."""
        mark = f"omnistage-mark={next(self._marks)}"
        httpx.get(f"{self.url}/moto-api/data.json?{mark}", timeout=timeout)
        deadline = time.monotonic() + timeout
        with self._seen:
            while not any(mark in line for line in self._log):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"the S3 server never logged {mark}")
                self._seen.wait(left)
            lines = list(self._log)
        found = (_LINE.search(line) for line in lines)
        return [(m[1], m[2], int(m[3])) for m in found if m and "/moto-api/" not in m[2]]

    def gets(self) -> tuple[int, int]:
        """(listings, object downloads) answered 200 in the bucket so far."""
        ok = [path for method, path, status in self.requests() if (method, status) == ("GET", 200)]
        listings = sum(1 for p in ok if p.startswith(f"/{self.bucket}?list-type=2"))
        objects = sum(1 for p in ok if p.startswith(f"/{self.bucket}/"))
        return listings, objects

    def stop(self) -> None:
        if self._proc is None:
            return
        proc, self._proc = self._proc, None
        if proc.stdin is not None:
            proc.stdin.close()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=15)

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


if __name__ == "__main__":
    _serve()
