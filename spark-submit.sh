#!/usr/bin/env bash
# Submit a replica job with the right packages and configuration: locally by default, or to a cluster.
#
#   ./spark-submit.sh jobs/materialize.py conf/orders_a.toml                 # local[2]
#   ./spark-submit.sh --master spark://host:7077 jobs/materialize.py conf/orders_a.toml
#
# Any spark-submit option may come before the job file. The Spark extras (Delta, Spark's Kafka source) are
# passed as --packages, resolved by Spark's Ivy from Maven Central into the project's cache (.state/ivy) once;
# on a cluster the same coordinates are resolved there, and replica_lib is shipped with --py-files.
set -euo pipefail
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/scripts/bootstrap.sh"
replica_bootstrap

master=""
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
  case "${args[i]}" in
    --master) master="${args[i + 1]:-}" ;;
    --master=*) master="${args[i]#--master=}" ;;
  esac
done

extra=()
if [[ -z "$master" ]]; then
  extra+=(--master "local[2]" --driver-memory 2g
    --conf spark.driver.host=127.0.0.1 --conf spark.driver.bindAddress=127.0.0.1
    --conf spark.sql.shuffle.partitions=4 --conf spark.databricks.delta.snapshotPartitions=2)
elif [[ "$master" != local* ]]; then
  mkdir -p "$STATE/dist"
  (cd "$ROOT" && rm -f "$STATE/dist/replica_lib.zip" && "$PY" -m zipfile -c "$STATE/dist/replica_lib.zip" replica_lib >/dev/null)
  extra+=(--py-files "$STATE/dist/replica_lib.zip")
fi

packages=$("$PY" -c 'from replica_lib.artifacts import SPARK_PACKAGES; print(",".join(SPARK_PACKAGES))')
exec "$VENV/bin/spark-submit" \
  --packages "$packages" \
  --conf "spark.jars.ivy=$STATE/ivy" \
  --conf "spark.jars.ivySettings=$ROOT/replica_lib/resources/ivysettings.xml" \
  --conf spark.sql.extensions=io.delta.sql.DeltaSparkSessionExtension \
  --conf spark.sql.catalog.spark_catalog=org.apache.spark.sql.delta.catalog.DeltaCatalog \
  --conf spark.ui.showConsoleProgress=false \
  "${extra[@]}" "$@"
