"""Install-time warm-up: liburing's import cache is written once, by one process."""

from __future__ import annotations


def main() -> None:
    # liburing 2024.5.3 writes an import cache beside itself on first import; make it now, in
    # one process, rather than in several workers at once
    from io_engine.ioqueue import import_liburing

    import_liburing()


if __name__ == "__main__":
    main()
