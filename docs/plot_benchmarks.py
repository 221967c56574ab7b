"""Draws the benchmark plots of ``benchmarks.rst`` from ``benchmarks/RESULTS.rst``.

Run by every docs build (``conf.py``), so that the plots show the tables as
they are committed; ``python docs/plot_benchmarks.py OUT`` draws them into
the folder ``OUT``.
"""

import pathlib
import re
import sys

import matplotlib

matplotlib.use('Agg')  # no display: the plots are files

import matplotlib.pyplot as plt

RESULTS = pathlib.Path(__file__).resolve().parent.parent / 'benchmarks' / 'RESULTS.rst'


def simple_table(text, title):
    """The rows of the first simple table after the section ``title``, as
    dicts from the header's column names to the cells."""
    lines = text.splitlines()
    start = lines.index(title)
    borders = [i for i in range(start, len(lines)) if re.fullmatch(r'=+( +=+)*', lines[i])]
    top, header_end, bottom = borders[:3]
    spans = []
    column = 0
    for word in lines[top].split():
        column = lines[top].index(word, column)
        spans.append((column, column + len(word)))
        column += len(word)

    def cells(line):
        # the last column may run past its border
        return [line[a:b if k < len(spans) - 1 else None].strip()
                for k, (a, b) in enumerate(spans)]

    names = cells(lines[top + 1])
    return [dict(zip(names, cells(line), strict=True)) for line in lines[header_end + 1:bottom]]


def grouped_bars(rows, series, title, path):
    """One group of bars per row (a model size), one bar per ``(column,
    label)`` of ``series``, on a log scale: the sizes span 100x."""
    figure, axes = plt.subplots(figsize=(7, 3.6))
    width = 0.8 / len(series)
    for k, (column, label) in enumerate(series):
        axes.bar([i + k * width for i in range(len(rows))],
                 [float(row[column]) for row in rows], width, label=label)
    axes.set_xticks([i + width * (len(series) - 1) / 2 for i in range(len(rows))],
                    [f"{row['params']} parameters" for row in rows])
    axes.set_yscale('log')
    axes.set_ylabel('ms (median of 5, log scale)')
    axes.set_title(title)
    axes.legend(fontsize='small')
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def main(out):
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    text = RESULTS.read_text()
    grouped_bars(simple_table(text, 'Whole-state checkpoint, one process'),
                 [('disk', 'one fsynced file of the same size (disk)'),
                  ('save_state+fsync', 'save_state + fsync'),
                  ('ours', 'AccelerateCheckpoint'),
                  ('async blocked', 'async_save=True: training blocked')],
                 'Whole-state checkpoint with Adam, one process',
                 out / 'bench_whole_state.png')
    grouped_bars(simple_table(text, "ParamsCheckpoint vs skorch's Checkpoint, one process"),
                 [('skorch Checkpoint', "skorch's Checkpoint"),
                  ('skorch Checkpoint+fsync', "skorch's Checkpoint + fsync"),
                  ('ParamsCheckpoint', 'ParamsCheckpoint')],
                 'Parameters and optimizer, one process',
                 out / 'bench_params.png')


if __name__ == '__main__':
    main(sys.argv[1])
