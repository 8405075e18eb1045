"""The Parquet archive of dropped days: written by retention, read back by `rtrl history import`,
rewritten by erasure.

Layout under the archive URL (a directory or any fsspec URL such as s3://bucket/rtrl):
`<table>/day=<YYYY-MM-DD>/<table>-<YYYYMMDD>-<id>.parquet`, one file per export, never
overwritten by a later export. JSONB columns are stored as JSON text, UUIDs as text, so
every file has the schema its table's columns dictate, whatever the rows hold.
"""

from __future__ import annotations

import enum
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import date
from typing import Any

import fsspec
import orjson
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from fsspec.core import url_to_fs
from sqlalchemy import (
    ARRAY,
    BigInteger,
    Boolean,
    Date,
    DateTime,
    Enum,
    Float,
    Integer,
    String,
    Table,
    Text,
    Uuid,
)
from sqlalchemy.dialects.postgresql import JSONB

ROW_GROUP = 10_000
"""Rows per Parquet row group, and per batch read back."""


@dataclass(frozen=True)
class Archive:
    """An archive location: its file system and root path."""

    fs: fsspec.AbstractFileSystem
    root: str

    @classmethod
    def at(cls, url: str) -> Archive:
        fs, root = url_to_fs(url)
        return cls(fs, root.rstrip("/"))

    def day_dir(self, table: str, day: date) -> str:
        return f"{self.root}/{table}/day={day.isoformat()}"

    def files(self, table: str) -> list[str]:
        """Every Parquet file of `table`, oldest day first."""
        pattern = f"{self.root}/{table}/day=*/*.parquet"
        return sorted(self.fs.glob(pattern))


def arrow_type(column_type: Any) -> pa.DataType:
    """The Parquet type of a column: JSON and UUIDs as text, arrays as lists."""
    if isinstance(column_type, JSONB):
        return pa.string()
    if isinstance(column_type, ARRAY):
        return pa.list_(arrow_type(column_type.item_type))
    if isinstance(column_type, BigInteger):
        return pa.int64()
    if isinstance(column_type, Integer):
        return pa.int32()
    if isinstance(column_type, Float):
        return pa.float64()
    if isinstance(column_type, Boolean):
        return pa.bool_()
    if isinstance(column_type, DateTime):
        return pa.timestamp("us", tz="UTC")
    if isinstance(column_type, Date):
        return pa.date32()
    if isinstance(column_type, String | Text | Enum | Uuid):
        return pa.string()
    raise TypeError(f"no Parquet type for {column_type!r}")


def arrow_schema(table: Table) -> pa.Schema:
    return pa.schema([pa.field(c.name, arrow_type(c.type), nullable=c.nullable) for c in table.c])


def _to_cell(column_type: Any) -> Callable[[Any], Any]:
    if isinstance(column_type, JSONB):
        return lambda value: None if value is None else orjson.dumps(value).decode()
    if isinstance(column_type, Uuid):
        return lambda value: None if value is None else str(value)
    if isinstance(column_type, Enum):
        return lambda value: value.value if isinstance(value, enum.Enum) else value
    return lambda value: value


def _from_cell(column_type: Any) -> Callable[[Any], Any]:
    if isinstance(column_type, JSONB):
        return lambda value: None if value is None else orjson.loads(value)
    if isinstance(column_type, Uuid):
        return lambda value: None if value is None else uuid.UUID(value)
    return lambda value: value


def write_file(
    archive: Archive, table: Table, day: date, batches: Iterable[Sequence[Any]]
) -> tuple[str, int]:
    """Write rows (in `table`'s column order) of one day as a new file; its path and rows.

    Written under a temporary name and renamed, so a reader never sees half a file.
    """
    schema = arrow_schema(table)
    cells = [_to_cell(column.type) for column in table.c]
    directory = archive.day_dir(table.name, day)
    archive.fs.makedirs(directory, exist_ok=True)
    path = f"{directory}/{table.name}-{day:%Y%m%d}-{uuid.uuid4().hex[:12]}.parquet"
    written = 0
    with archive.fs.open(path + ".tmp", "wb") as out, pq.ParquetWriter(out, schema) as writer:
        for batch in batches:
            columns = list(zip(*batch, strict=True)) if batch else [() for _ in cells]
            arrays = [
                pa.array([cell(value) for value in values], type=field.type)
                for cell, values, field in zip(cells, columns, schema, strict=True)
            ]
            writer.write_table(pa.Table.from_arrays(arrays, schema=schema))
            written += len(batch)
    archive.fs.mv(path + ".tmp", path)
    return path, written


def read_file(archive: Archive, table: Table, path: str) -> Iterator[list[dict[str, Any]]]:
    """The rows of one archived file, in batches, as dicts ready to insert into `table`."""
    converters = {column.name: _from_cell(column.type) for column in table.c}
    with archive.fs.open(path, "rb") as source:
        for batch in pq.ParquetFile(source).iter_batches(batch_size=ROW_GROUP):
            yield [
                {name: converters[name](value) for name, value in row.items()}
                for row in batch.to_pylist()
            ]


def rewrite_without(
    archive: Archive, path: str, columns: Sequence[str], drop: Callable[[pa.Table], pa.Array]
) -> pa.Table | None:
    """Rewrite a file without the rows `drop` marks; the dropped rows, None if none were.

    Only `columns` (what `drop` reads) are read of a file that holds no such row, so a search
    costs a column, not the prompts. A file left with no rows is deleted.
    """
    with archive.fs.open(path, "rb") as source:
        keys = pq.read_table(source, columns=list(columns))
    if not pc.any(pc.fill_null(drop(keys), False)).as_py():
        return None
    with archive.fs.open(path, "rb") as source:
        rows = pq.read_table(source)
    dropped = pc.fill_null(drop(rows), False)
    kept = rows.filter(pc.invert(dropped))
    if kept.num_rows == 0:
        archive.fs.rm(path)
    else:
        with archive.fs.open(path + ".tmp", "wb") as out:
            pq.write_table(kept, out)
        archive.fs.mv(path + ".tmp", path)
    return rows.filter(dropped)
