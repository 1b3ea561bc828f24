"""Pure render functions: each takes plain arguments and returns a matplotlib ``Figure`` or an ``HTML`` string.

Notebooks and the widgets in ``workbench.explorer`` only call these; ``tests/cpu/test_render*.py`` calls them headless.
All layout facts come from ``workbench.formats``; nothing here re-implements a map.
"""
from workbench.render._draw import HTML, html_table
from workbench.render.accuracy import (errors_html, load_minilm_weights, minilm_path, output_errors,
                                       output_errors_html, quantization_errors, render_error_chart,
                                       render_output_error_chart)
from workbench.render.bench import load_family, load_results, validate_results
from workbench.render.fp8 import (block_scales_html, fp8_examples_html, render_block_fp8_scale_map,
                                  render_block_fp8_word, render_fp8_bit_move, render_gate_up_fusion)
from workbench.render.packing import awq_order_html, qzeros_html, render_awq_packing, render_gptq_packing
from workbench.render.scales import lane_scale_columns_html, render_scale_permutation
from workbench.render.stacks import expert_stack_html, render_act_order, render_expert_stack
from workbench.render.tile import (field_table_html, position_path_html, render_field_interleave, render_lane_words,
                                   render_layout, render_mma_fragment, render_subblocks, word_sources_html, words_html)

__all__ = [name for name in dir() if not name.startswith("_")]
