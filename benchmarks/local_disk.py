"""A pyarrow filesystem handler over local disk whose checkpoint writes a subclass can fail, stall or
hold: the base of the soak's storage (:mod:`benchmarks.soak.storage`) and of the tests' faulty
filesystems (``tests/faulty_fs.py``).

Used through ``pyarrow.fs.PyFileSystem(handler)``, so the whole engine (the holders' writers, the
controller's commits, the workers' restores) runs for real against it; it is pickled into each of
those processes (a subclass gives its ``__reduce__``). Every write goes through :meth:`_check` first
(a no-op here). No torch and no cf_ray imports.
"""

from __future__ import annotations

import pyarrow.fs as pafs


class LocalDiskHandler(pafs.FileSystemHandler):
    """Local disk underneath; ``open_output_stream``/``open_append_stream`` call :meth:`_check`."""

    def __init__(self):
        self.fs = pafs.LocalFileSystem()

    def _check(self, path: str) -> None:
        """Called before each write of ``path``: raise or block to inject a fault."""

    def get_type_name(self):
        return "local-disk"

    def equals(self, other):
        return type(other) is type(self) and other.__reduce__() == self.__reduce__()

    def normalize_path(self, path):
        return path

    def get_file_info(self, paths):
        return self.fs.get_file_info(paths)

    def get_file_info_selector(self, selector):
        return self.fs.get_file_info(selector)

    def create_dir(self, path, recursive):
        self.fs.create_dir(path, recursive=recursive)

    def delete_dir(self, path):
        self.fs.delete_dir(path)

    def delete_dir_contents(self, path, missing_dir_ok=False):
        self.fs.delete_dir_contents(path, missing_dir_ok=missing_dir_ok)

    def delete_root_dir_contents(self):
        raise OSError("refusing to delete the root")

    def delete_file(self, path):
        self.fs.delete_file(path)

    def move(self, src, dest):
        self.fs.move(src, dest)

    def copy_file(self, src, dest):
        self.fs.copy_file(src, dest)

    def open_input_stream(self, path):
        return self.fs.open_input_stream(path)

    def open_input_file(self, path):
        return self.fs.open_input_file(path)

    def open_output_stream(self, path, metadata):
        self._check(path)
        return self.fs.open_output_stream(path, metadata=metadata)

    def open_append_stream(self, path, metadata):
        self._check(path)
        return self.fs.open_append_stream(path, metadata=metadata)


__all__ = ["LocalDiskHandler"]
