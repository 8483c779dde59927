"""Waltz for Spark: the log as a PySpark data source and DataFrames as transactions."""
