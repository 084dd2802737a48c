"""`python -m kvfence` = the `kvfence` command (used to start child roles)."""

from kvfence.cli import main

if __name__ == "__main__":
    main()
