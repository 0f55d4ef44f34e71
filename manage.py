#!/usr/bin/env python
import os
import sys

from config.openmp import exec_under_intel_openmp


def main() -> None:
    # Before Django or torch: the commands that run engines start again under Intel OpenMP where it is
    # installed (config/openmp.py says why).
    exec_under_intel_openmp(sys.argv)
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)


if __name__ == "__main__":
    main()
