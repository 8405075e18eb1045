"""The history's lifecycle: daily partitions, retention to a Parquet archive, erasure."""
