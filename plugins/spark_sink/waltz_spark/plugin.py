"""Entry-point plugin module: the ``waltz spark ...`` commands.

The PySpark data source ``waltz`` is registered with a SparkSession, not with Waltz
(:func:`waltz_spark.session.register`). Nothing here imports PySpark at import time (``waltz
--help`` stays fast).
"""

from __future__ import annotations

import click

from waltz_core import hookimpl


@click.group("spark")
def spark_group() -> None:
    """Spark jobs over the log (PySpark data source 'waltz')."""


@spark_group.command("summarize")
@click.option("--config", "config_path", required=True, type=click.Path(exists=True, dir_okay=False),
              help="Client TOML file of the cluster (as written by `waltz up`).")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Directory for the Parquet tables.")
@click.option("--partitions", default="", help="Only these Waltz partitions (e.g. '0,2-3').")
@click.option("--master-cores", default=2, show_default=True, help="Cores of the local Spark master.")
def summarize_command(config_path: str, out: str, partitions: str, master_cores: int) -> None:
    """Per-account balances and daily totals of the demo bank's log, written to Parquet."""
    from .session import local_session
    from .summarize import summarize

    options = {"config": config_path}
    if partitions:
        options["partitions"] = partitions
    spark = local_session("waltz-spark-summarize", cores=master_cores)
    try:
        counts = summarize(spark, options, out)
    finally:
        spark.stop()
    click.echo(f"{counts['operations']} operations -> {counts['accounts']} account balances, "
               f"{counts['days']} daily totals in {out}")


@spark_group.command("count")
@click.option("--config", "config_path", required=True, type=click.Path(exists=True, dir_okay=False),
              help="Client TOML file of the cluster.")
@click.option("--partitions", default="", help="Only these Waltz partitions (e.g. '0,2-3').")
def count_command(config_path: str, partitions: str) -> None:
    """Count the transactions of the log per partition with a Spark batch read."""
    from .session import local_session

    spark = local_session("waltz-spark-count")
    try:
        reader = spark.read.format("waltz").option("config", config_path)
        if partitions:
            reader = reader.option("partitions", partitions)
        for row in reader.load().groupBy("partition").count().orderBy("partition").collect():
            click.echo(f"partition {row['partition']}: {row['count']} transactions")
    finally:
        spark.stop()


@hookimpl
def waltz_add_commands(cli: click.Group) -> None:
    cli.add_command(spark_group)
