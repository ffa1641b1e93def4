# Sourced by ./replica and ./spark-submit.sh: makes sure this checkout can run (Python venv with the pinned
# dependencies, Java 17+), then exports ROOT, STATE, VENV and PY. Every failure is one line with the fix.
# shellcheck shell=bash

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
STATE="${REPLICA_STATE_DIR:-$ROOT/.state}"
VENV="$STATE/venv"
PY="$VENV/bin/python"
export REPLICA_STATE_DIR="$STATE"

replica_die() { echo "replica: $*" >&2; exit 2; }

replica_check_java() {
  local java="java"
  [[ -n "${JAVA_HOME:-}" ]] && java="$JAVA_HOME/bin/java"
  command -v "$java" >/dev/null 2>&1 || replica_die "no Java found: install Java 17+ (apt-get install openjdk-17-jre-headless) or set JAVA_HOME"
  local version major
  version=$("$java" -version 2>&1 | sed -n 's/.*version "\([^"]*\)".*/\1/p' | head -n 1)
  major=${version%%.*}
  [[ "$major" == 1 ]] && major=$(echo "$version" | cut -d. -f2)
  [[ "$major" =~ ^[0-9]+$ && "$major" -ge 17 ]] || replica_die "Java 17 or newer is required, found '${version:-unknown}' ($java): install openjdk-17-jre-headless or set JAVA_HOME"
}

replica_bootstrap() {
  replica_check_java
  local python="${REPLICA_PYTHON:-python3}"
  command -v "$python" >/dev/null 2>&1 || replica_die "python3 not found: install Python 3.11+ (apt-get install python3 python3-venv)"
  "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || replica_die "Python 3.11+ is required, found $("$python" --version 2>&1): install a newer python3 or set REPLICA_PYTHON"
  mkdir -p "$STATE"
  local stamp="$STATE/venv.stamp" want
  want=$(cat "$ROOT/pyproject.toml" "$ROOT/requirements-peer.txt" | sha256sum | cut -d' ' -f1)
  if [[ ! -x "$PY" || ! -f "$stamp" || "$(cat "$stamp")" != "$want" ]]; then
    echo "replica: installing Python dependencies into $VENV (first run takes a minute or two) ..." >&2
    if [[ ! -x "$PY" ]]; then
      "$python" -m venv "$VENV" >"$STATE/pip.log" 2>&1 || replica_die "creating the virtualenv failed (see $STATE/pip.log): install python3-venv (apt-get install python3-venv)"
    fi
    # The benchmark's peer (kafka2delta) goes in without dependency resolution: see requirements-peer.txt.
    { "$PY" -m pip install --upgrade pip && "$PY" -m pip install -e "$ROOT[dev]" \
      && "$PY" -m pip install --no-deps -r "$ROOT/requirements-peer.txt"; } >>"$STATE/pip.log" 2>&1 \
      || replica_die "pip install failed (see $STATE/pip.log): check access to PyPI and retry"
    echo "$want" >"$stamp"
  fi
  export VIRTUAL_ENV="$VENV" PATH="$VENV/bin:$PATH" PYSPARK_PYTHON="$PY" PYSPARK_DRIVER_PYTHON="$PY"
  # The local Spark of ./replica's own commands (setup, demo, chaos) binds to the loopback interface, as the local
  # jobs of spark-submit.sh do; on a machine whose name resolves to it Spark otherwise warns at every start.
  export SPARK_LOCAL_IP="${SPARK_LOCAL_IP:-127.0.0.1}"
}

# Prints the class-data archive for this Java and Spark, making it first if there is none: once, about a minute
# (jobs/class_archive.py in a JVM started with -XX:ArchiveClassesAtExit). Every later start maps the classes from it
# instead of reading and verifying them from the jars: ~4 s of a ~19 s start, a materialize job's 31 s to 27 s.
# The arguments are the launch's spark-submit options. A failed attempt is kept beside the archive's place
# (*.failed, with its log) and not retried; REPLICA_CLASS_ARCHIVE=off starts without one. A new archive replaces
# those of an earlier Java or pyspark.
replica_class_archive() {
  [[ "${REPLICA_CLASS_ARCHIVE:-on}" == off ]] && return 0
  local java="java" jars key dir archive log
  [[ -n "${JAVA_HOME:-}" ]] && java="$JAVA_HOME/bin/java"
  jars=$(compgen -G "$VENV/lib/python3*/site-packages/pyspark/jars" | head -n 1)
  [[ -n "$jars" ]] || return 0
  # The JVM refuses an archive whose Java, or whose class path's jars (name, size, time), have changed.
  key=$({ readlink -f "$(command -v "$java")"; "$java" -version 2>&1; stat -c '%n %s %Y' "$jars"/*.jar; } \
    | sha256sum | cut -c1-16)
  dir="$STATE/class-archive"
  archive="$dir/spark-$key.jsa"
  if [[ -f "$archive" ]]; then echo "$archive"; return 0; fi
  [[ -f "$archive.failed" ]] && return 0
  mkdir -p "$dir"
  exec 9>"$archive.lock"
  flock -w 600 9 || return 0  # another launch is making it: wait for it
  [[ -f "$archive" ]] && { echo "$archive"; return 0; }
  [[ -f "$archive.failed" ]] && return 0
  log="$dir/spark-$key.log"
  echo "replica: making a class archive for faster job starts (once per Java and pyspark, about a minute) ..." >&2
  rm -f "$archive.tmp"
  local args=("$@" --conf "spark.driver.defaultJavaOptions=-XX:ArchiveClassesAtExit=$archive.tmp")
  local status=0
  (cd "$ROOT" && SPARK_LOCAL_IP=127.0.0.1 PYSPARK_SUBMIT_ARGS="$(printf '%q ' "${args[@]}")pyspark-shell" \
    "$PY" -m jobs.class_archive) >"$log" 2>&1 || status=$?
  if [[ "$status" == 0 && -s "$archive.tmp" ]]; then
    mv "$archive.tmp" "$archive"
    # Those of an earlier Java or pyspark go: ~200 MB each (a JVM that maps one keeps it until it exits).
    find "$dir" -maxdepth 1 -name 'spark-*' ! -name "spark-$key.*" -delete
    echo "$archive"
  elif [[ "$status" == 3 ]]; then  # jobs.class_archive.NOT_STARTED: Spark did not start; the job will say why, the next start tries again
    rm -f "$archive.tmp"
  else
    rm -f "$archive.tmp"
    echo "the class-data archive could not be made (see $log); remove this file to try again" >"$archive.failed"
    echo "replica: could not make the class archive (see $log); jobs start without it" >&2
  fi
}
