from pathlib import Path

WORKERS = Path(__file__).resolve().parent  # the worker scripts the launches run
