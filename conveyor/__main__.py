import sys

from conveyor.cli import main

if __name__ == "__main__":  # not when the engine process (multiprocessing spawn) imports it
    sys.exit(main())
