"""The Batch API's store on its own (real SQLite, real files): a line is answered once, finishing can be repeated
after a kill at any point, deleted inputs stay while a batch reads them, disk use is counted, and a server only
takes on the batches made on its own model."""

from __future__ import annotations

from conveyor.server.batch.store import BatchStore, LineResult


def upload(store: BatchStore, owner: str, lines: int = 3):
    tmp = store.temp_path()
    tmp.write_text("{}\n" * lines)
    return store.add_file(owner, "batch", "in.jsonl", tmp, lines)


def test_a_line_is_answered_once_and_the_files_hold_each_line_once(tmp_path):
    store = BatchStore(tmp_path)
    f = upload(store, "me")
    b = store.create_batch("me", None, "tiny", "/v1/completions", f, "24h", 3600, {"k": "v"})
    assert store.add_result(b.id, LineResult(2, "b", True, '{"line": 2}', 5, 1, 7))
    assert not store.add_result(b.id, LineResult(2, "b", False, '{"again": 2}')), "a line is answered once"
    assert store.add_result(b.id, LineResult(1, "a", False, '{"line": 1}'))
    assert store.add_result(b.id, LineResult(3, "c", True, '{"line": 3}', 1, 0, 2))
    rec = store.get_batch("me", b.id)
    assert (rec.completed, rec.failed, rec.input_tokens, rec.cached_tokens, rec.output_tokens) == (2, 1, 6, 1, 9)
    assert store.get_batch("someone else", b.id) is None and store.done_lines(b.id) == {1, 2, 3}
    first = store.write_outputs(rec)
    again = store.write_outputs(rec)  # killed after writing, before recording: written again, recorded once
    for _, (path, _) in first.items():
        path.unlink()
    done = store.complete(rec, "completed", again)
    assert done.status == "completed" and done.times["completed_at"] and done.error_file_id
    assert store.content_path(done.output_file_id).read_text() == '{"line": 2}\n{"line": 3}\n'
    assert store.content_path(done.error_file_id).read_text() == '{"line": 1}\n'
    assert store.done_lines(b.id) == set(), "the results moved into the files"
    assert store.get_file("me", done.output_file_id).purpose == "batch_output"
    store.close()
    reopened = BatchStore(tmp_path)
    assert reopened.get_batch(None, b.id).to_api()["request_counts"] == {"total": 3, "completed": 2, "failed": 1}
    assert reopened.disk_bytes() >= sum(p.stat().st_size for p in (tmp_path / "files").iterdir())


def test_deleted_inputs_stay_while_a_batch_reads_them(tmp_path):
    store = BatchStore(tmp_path)
    f = upload(store, "me")
    b = store.create_batch("me", None, "tiny", "/v1/completions", f, "24h", 3600, None)
    assert store.delete_file("me", f.id) and store.get_file("me", f.id) is None
    assert store.content_path(f.id).exists(), "the running batch still reads it"
    store.complete(store.get_batch(None, b.id), "cancelled", store.write_outputs(store.get_batch(None, b.id)))
    assert not store.content_path(f.id).exists()
    on_disk = sum(p.stat().st_size for p in tmp_path.rglob("*") if p.is_file() and p.name != "lock"
                  and not p.name.endswith("-shm"))
    assert store.disk_bytes() == on_disk, "what --batch-max-disk-bytes holds the store to is what it takes"


def test_a_server_takes_on_only_the_batches_of_its_model(tmp_path):
    store = BatchStore(tmp_path)
    f = upload(store, "me")
    mine = store.create_batch("me", None, "tiny", "/v1/completions", f, "24h", 3600, None)
    other = store.create_batch("me", None, "other-model", "/v1/completions", f, "24h", 3600, None)
    assert [r.id for r in store.unfinished_batches("tiny")] == [mine.id]
    assert {r.id for r in store.unfinished_batches()} == {mine.id, other.id}
    page, more = store.list_batches("me", None, 1)
    assert [r.id for r in page] == [other.id] and more
    assert [r.id for r in store.list_batches("me", other.id, 5)[0]] == [mine.id]
