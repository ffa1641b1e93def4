#!/usr/bin/env bash
# Submit a replica job with the right packages and configuration: locally by default, or to a cluster.
#
#   ./spark-submit.sh jobs/materialize.py conf/orders_a.toml                 # local[2]
#   ./spark-submit.sh --master spark://host:7077 jobs/materialize.py conf/orders_a.toml
#
# Any spark-submit option may come before the job file. The Spark extras (Delta, Spark's Kafka source, and a
# job's own, e.g. spark-avro for jobs/dev/bench.py) are passed as --packages, resolved by Spark's Ivy from Maven
# Central into the project's cache (.state/ivy) once, and as the jars resolved then on later local starts; on a
# cluster the same coordinates are resolved there, and replica_lib is shipped with --py-files.
set -euo pipefail
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/scripts/bootstrap.sh"
replica_bootstrap

master=""
deploy_mode=client
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
  case "${args[i]}" in
    --master) master="${args[i + 1]:-}" ;;
    --master=*) master="${args[i]#--master=}" ;;
    --deploy-mode) deploy_mode="${args[i + 1]:-}" ;;
    --deploy-mode=*) deploy_mode="${args[i]#--deploy-mode=}" ;;
  esac
done

# The job file is the first *.py argument; dev jobs (jobs/dev/) may need packages of their own (replica_dev.maven).
job=""
for arg in "$@"; do
  if [[ "$arg" == *.py ]]; then job="$arg"; break; fi
done
module=replica_lib.artifacts
[[ "$job" == */dev/* ]] && module=replica_dev.maven
packages=$("$PY" -c "import sys; from $module import packages_for; print(','.join(packages_for(sys.argv[1])))" "$job")
# A local driver takes the jars Ivy resolved for these packages at an earlier local start, if they are recorded and
# still cached (replica_lib.artifacts.resolved_jars): Ivy's resolution costs ~1.5 s of every start, even offline.
# The empty spark.jars.packages overrides the session's own (replica_lib.session), which would resolve them again.
dependencies=(--packages "$packages")
if [[ -z "$master" || "$master" == local* ]]; then
  jars=$("$PY" -c "import sys; from pathlib import Path; from replica_lib.artifacts import resolved_jars; print(','.join(resolved_jars(sys.argv[1].split(','), Path(sys.argv[2]))))" "$packages" "$STATE/ivy")
  [[ -n "$jars" ]] && dependencies=(--jars "$jars" --conf "spark.jars.packages=")
fi
# The SQL server's JDBC sessions load Delta from the JVM's own class path (replica_lib.artifacts.driver_classpath).
classpath=$("$PY" -c "import sys; from pathlib import Path; from replica_lib.artifacts import driver_classpath; print(':'.join(driver_classpath(sys.argv[1], Path(sys.argv[2]))))" "$job" "$STATE/ivy")
common=(
  "${dependencies[@]}"
  --conf "spark.jars.ivy=$STATE/ivy"
  --conf "spark.jars.ivySettings=$ROOT/replica_lib/resources/ivysettings.xml"
  --conf spark.sql.extensions=io.delta.sql.DeltaSparkSessionExtension
  --conf spark.sql.catalog.spark_catalog=org.apache.spark.sql.delta.catalog.DeltaCatalog
  --conf spark.ui.showConsoleProgress=false
)
[[ -n "$classpath" ]] && common+=(--driver-class-path "$classpath")
# The JIT compiles methods of any size, in the driver and the executors (replica_lib.session.JAVA_OPTIONS says why).
# The driver also logs a record on one line, without its stack trace, unless REPLICA_DEBUG asks for traces.
jit="-XX:-DontCompileHugeMethods"
driver_options=$("$PY" -c "from replica_lib.config import local_settings; from replica_lib.session import driver_java_options; print(driver_java_options(local_settings()))")
# A driver on this machine maps Spark's classes from an archive (replica_class_archive in scripts/bootstrap.sh),
# unless jars come before Spark's on its class path (the SQL server's), which the archive's JVM did not have.
if [[ "$deploy_mode" == client && -z "$classpath" ]]; then
  archive=$(replica_class_archive "${common[@]}" --master "local[2]" \
    --conf spark.driver.host=127.0.0.1 --conf spark.driver.bindAddress=127.0.0.1) || archive=""
  [[ -n "$archive" ]] && driver_options+=" -XX:SharedArchiveFile=$archive"
fi
common+=(--conf "spark.driver.defaultJavaOptions=$driver_options" --conf "spark.executor.defaultJavaOptions=$jit")

if [[ -z "$master" || "$master" == local* ]]; then
  # Locally the job's Python process is the driver and starts Spark's JVM itself (as pyspark does), so
  # SIGTERM/Ctrl-C reach the job, which stops after the current batch; the JVM exits with it.
  [[ -z "$master" ]] && common+=(--master "local[2]")
  common+=(--driver-memory 2g
    --conf spark.driver.host=127.0.0.1 --conf spark.driver.bindAddress=127.0.0.1
    --conf spark.sql.shuffle.partitions=4 --conf spark.databricks.delta.snapshotPartitions=2  # as session.session_conf
    --conf spark.sql.sources.parallelPartitionDiscovery.parallelism=4)
  options=()
  while [[ $# -gt 0 && "$1" != *.py ]]; do options+=("$1"); shift; done
  [[ $# -gt 0 ]] || replica_die "no job file given: ./spark-submit.sh [spark options] jobs/<job>.py [job arguments]"
  export SPARK_LOCAL_IP="${SPARK_LOCAL_IP:-127.0.0.1}"
  export PYSPARK_SUBMIT_ARGS="$(printf '%q ' "${common[@]}" "${options[@]}")pyspark-shell"
  exec "$PY" "$@"
fi

mkdir -p "$STATE/dist"
(cd "$ROOT" && rm -f "$STATE/dist/replica_lib.zip" && "$PY" -m zipfile -c "$STATE/dist/replica_lib.zip" replica_lib >/dev/null)
exec "$VENV/bin/spark-submit" "${common[@]}" --py-files "$STATE/dist/replica_lib.zip" "$@"
