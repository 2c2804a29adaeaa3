"""Runs the Python in $SCRIPT: a stand-in service for the launcher's environment test."""

import os

exec(os.environ["SCRIPT"])
