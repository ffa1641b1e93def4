"""Install everything a fresh checkout needs (the venv is made by ./replica itself): ./replica setup"""

from __future__ import annotations

import sys

from jobs._cli import guarded, setup_logging
from replica_dev import maven
from replica_lib import artifacts
from replica_lib.config import local_settings
from replica_lib.session import build_session


def main(argv: list[str]) -> int:
    setup_logging()
    settings = local_settings()

    def body() -> int:
        java = maven.find_java(settings.java_home)
        print(f"Java {java.major}: {java.executable}")
        for name, (packages, what) in maven.LOCAL_TOOLS.items():  # the first run downloads them: minutes
            jars = maven.resolve_jars(java, packages, settings.state_dir, name)
            print(f"{what}: {len(jars)} jars cached")
        spark = build_session("replica-setup", settings, master="local[1]")
        print(f"Spark {spark.version} with {', '.join(artifacts.SPARK_PACKAGES)}: ready")
        spark.stop()
        return 0

    return guarded(body)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
