"""Alembic environment: the URL comes from the config or from RTRL_DATABASE_URL."""

from __future__ import annotations

from logging.config import fileConfig

from alembic import context
from sqlalchemy import ForeignKeyConstraint, create_engine

from app.config import get_settings
from app.history.partitions import PARTITION_NAME
from app.models import Base

config = context.config
if config.config_file_name is not None and not config.attributes.get("skip_logging"):
    fileConfig(config.config_file_name, disable_existing_loggers=False)

target_metadata = Base.metadata


def include_name(name: str | None, type_: str, parent_names: object) -> bool:
    """Compare partitioned tables by their parents: the daily partitions are data, not schema."""
    return not (type_ == "table" and name is not None and PARTITION_NAME.match(name))


def include_object(
    obj: object, name: str | None, type_: str, reflected: bool, compare_to: object
) -> bool:
    """Skip the foreign keys Postgres derives to each partition of a referenced table."""
    if type_ == "foreign_key_constraint" and isinstance(obj, ForeignKeyConstraint):
        return not PARTITION_NAME.match(obj.referred_table.name)
    return True


def database_url() -> str:
    return config.get_main_option("sqlalchemy.url") or get_settings().database_url


def run_migrations_offline() -> None:
    context.configure(url=database_url(), target_metadata=target_metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    engine = create_engine(database_url())
    with engine.connect() as connection:
        context.configure(
            connection=connection,
            target_metadata=target_metadata,
            include_name=include_name,
            include_object=include_object,
        )
        with context.begin_transaction():
            context.run_migrations()
    engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
