"""Reading back what each tracker wrote, as the tools themselves would show it: MLflow's
client on the mlruns file store, the records of a W&B offline run (.wandb), TensorBoard's
event files and the CSV files. For tests/rank/test_loggers.py."""

import csv
import json
import struct
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


def mlflow_runs(mlruns: Path) -> list[dict]:
    """Every run of the file store: id, status, params, each metric's (step, value) history."""
    import os

    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow import MlflowClient

    client = MlflowClient(mlruns.resolve().as_uri())
    runs = []
    for experiment in client.search_experiments():
        for run in client.search_runs([experiment.experiment_id]):
            history = {key: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)]
                       for key in run.data.metrics}
            runs.append({"id": run.info.run_id, "status": run.info.status, "params": run.data.params,
                         "history": history, "name": run.info.run_name})
    return runs


def wandb_records(path: Path) -> list:
    """The protobuf records of one .wandb file: W&B's header (":W&B", magic, version: 7 bytes),
    then LevelDB's log format, records of (crc32, length, type) in 32 KiB blocks."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", path
    records, pending, offset, block = [], b"", 7, 32768
    while offset + 7 <= len(data):
        left = block - offset % block
        if left < 7:  # a block's tail too short for a header is padding
            offset += left
            continue
        length, kind = struct.unpack("<HB", data[offset + 4:offset + 7])
        payload = data[offset + 7:offset + 7 + length]
        offset += 7 + length
        if kind == 0 and length == 0:
            continue
        pending += payload
        if kind in (1, 4):  # FULL, LAST
            record = pb.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def wandb_runs(folder: Path) -> list[dict]:
    """Every offline run under ``folder``/wandb: its folder (offline-run-<time>-<id>), the id its
    run record holds, config, each key's (step, value) history, summary."""
    runs = []
    for path in sorted(folder.glob("wandb/offline-run-*/run-*.wandb")):
        run = {"id": None, "folder": path.parent.name, "config": {}, "history": {}, "summary": {}, "resumed": False}
        for record in wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run["id"], run["resumed"] = record.run.run_id, record.run.resumed
                run["config"].update({item.key: json.loads(item.value_json)
                                      for item in record.run.config.update})
            elif kind == "config":
                run["config"].update({item.key: json.loads(item.value_json) for item in record.config.update})
            elif kind == "history":
                row = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                       for item in record.history.item}
                for key, value in row.items():
                    if not key.startswith("_"):
                        run["history"].setdefault(key, []).append((row["_step"], value))
            elif kind == "summary":
                run["summary"].update({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                                       for item in record.summary.update})
        runs.append(run)
    return runs


def tensorboard_scalars(folder: Path) -> dict:
    """{event file name: {tag: [(step, value)]}} of each event file in ``folder``."""
    found = {}
    for path in sorted(folder.glob("events.out.tfevents.*")):
        events = EventAccumulator(str(path), size_guidance={"scalars": 0})
        events.Reload()
        found[path.name] = {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    return found


def csv_rows(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))
