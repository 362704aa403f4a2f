"""A large file streams through the edge: upload and download never hold it.

The edge's peak RSS (``VmHWM``) is read before and after a 96 MB upload and
download of the same file; its growth must stay far below the file's size,
which is what holding the file (once, let alone in a multipart buffer plus
a bytes copy) would cost.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from tests.pipeline import DEV_KEY, Pipeline, running_pipeline

pytestmark = pytest.mark.pipeline

SIZE = 96 << 20


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory, module_nats_url: str,
             module_redis_url: str) -> Iterator[Pipeline]:
    # The Files API needs only the edge and the broker.
    yield from running_pipeline(tmp_path_factory.mktemp("files"), module_nats_url,
                                module_redis_url, workers=0,
                                overrides={"batch": {"max_file_bytes": SIZE + (1 << 20)},
                                           "streams": {"storage": "file"}})


def peak_rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmHWM for {pid}")


async def test_large_upload_and_download_stay_bounded(pipeline: Pipeline,
                                                      tmp_path: Path) -> None:
    path = tmp_path / "big.jsonl"
    line = (b'{"custom_id": "x", "method": "POST", "url": "/v1/chat/completions", "body": '
            b'{"model": "tidegate-sim", "messages": [{"role": "user", "content": "' +
            b"y" * 800 + b'"}]}}\n')
    digest = hashlib.sha256()
    with path.open("wb") as out:
        written = 0
        while written < SIZE:
            out.write(line)
            digest.update(line)
            written += len(line)
    pid = pipeline.edge.pid
    assert pid is not None
    headers = {"Authorization": f"Bearer {DEV_KEY}"}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as http:
        # Warm the routes and the stores first, so the baseline holds them.
        async with http.get(f"{pipeline.base_url}/files", headers=headers) as resp:
            assert resp.status == 200
        before = peak_rss_kib(pid)
        with path.open("rb") as f:
            form = aiohttp.FormData()
            form.add_field("purpose", "batch")
            form.add_field("file", f, filename="big.jsonl")
            async with http.post(f"{pipeline.base_url}/files", data=form,
                                 headers=headers) as resp:
                assert resp.status == 200, await resp.text()
                file = await resp.json()
        assert file["bytes"] == written
        got = hashlib.sha256()
        size = 0
        async with http.get(f"{pipeline.base_url}/files/{file['id']}/content",
                            headers=headers) as resp:
            assert resp.status == 200
            async for chunk in resp.content.iter_chunked(1 << 16):
                got.update(chunk)
                size += len(chunk)
        after = peak_rss_kib(pid)
        async with http.delete(f"{pipeline.base_url}/files/{file['id']}",
                               headers=headers) as resp:
            assert resp.status == 200
    assert size == written
    assert got.hexdigest() == digest.hexdigest()
    growth_mib = (after - before) / 1024
    print(f"edge peak RSS growth over a {written >> 20} MiB upload + download: "
          f"{growth_mib:.1f} MiB")
    assert growth_mib < SIZE / (1 << 20) / 8, f"peak RSS grew {growth_mib:.1f} MiB"
