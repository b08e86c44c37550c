-- pandoc filter for the roff man pages (debian/rules): each table becomes a definition list,
-- one entry per row, the row's first cell the term. pandoc's man writer sets a table's columns
-- in a fixed 70n, which at 80 columns runs past the right margin and leaves keys such as
-- max_held_gpu_hours_per_user no room; a man page lists keys as .TP entries anyway.
--
--   | Key | Type | Default | Meaning |     ->    version
--   | `version` | `1` | required | ... |              Type: 1. Default: required.
--                                                     Schema version.
--
-- The middle columns go on one line as "Header: cell.", the last column on the next line,
-- without its header where that is "Meaning".

local function inlines(blocks)
  return pandoc.utils.blocks_to_inlines(blocks)
end

local function text(blocks)
  return pandoc.utils.stringify(blocks)
end

function Table(tbl)
  local simple = pandoc.utils.to_simple_table(tbl)
  local headers = simple.headers
  local items = {}
  for _, row in ipairs(simple.rows) do
    local term = inlines(row[1])
    local fields = pandoc.List()
    for column = 2, #row - 1 do
      local cell = inlines(row[column])
      if #cell > 0 then
        if #fields > 0 then
          fields:insert(pandoc.Space())
        end
        fields:insert(pandoc.Emph({ pandoc.Str(text(headers[column]) .. ":") }))
        fields:insert(pandoc.Space())
        fields:extend(cell)
        if not text(row[column]):match("[.!?]$") then
          fields:insert(pandoc.Str("."))
        end
      end
    end
    local body = pandoc.List(fields)
    if #row > 1 then
      if #body > 0 then
        body:insert(pandoc.RawInline("man", "\n.br\n")) -- a LineBreak (.PD 0 .P) would end the .TP indent
      end
      if text(headers[#row]) ~= "Meaning" then -- "What it gets": said, as the middle columns are
        body:insert(pandoc.Emph({ pandoc.Str(text(headers[#row]) .. ":") }))
        body:insert(pandoc.Space())
      end
      body:extend(inlines(row[#row]))
    end
    table.insert(items, { term, { { pandoc.Para(body) } } })
  end
  return pandoc.DefinitionList(items)
end
